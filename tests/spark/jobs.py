"""DataFrames and queries the Spark tests write, in the test process (local mode, or a Spark Connect
client) or in a driver submitted to the standalone cluster (shipped there with ``faults``): nothing
here imports the tests' own services."""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeAlias

import pyarrow as pa
from pyspark.sql import DataFrame, SparkSession

if TYPE_CHECKING:
    from pyspark.sql.connect.dataframe import DataFrame as RemoteDataFrame
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

Session: TypeAlias = "SparkSession | RemoteSparkSession"
Frame: TypeAlias = "DataFrame | RemoteDataFrame"


def numbered(spark: Session, rows: int, partitions: int, keys: int = 7) -> Frame:
    """Rows 0..rows-1 spread over ``partitions`` in order; key = n % keys, value = n."""
    return spark.range(0, rows, 1, partitions).selectExpr(
        "cast(id % " + str(keys) + " as string) AS key", "cast(id as string) AS value", "id"
    )


def newest_first(spark: Session, rows: int, partitions: int) -> Frame:
    """Each of 5 keys' events newest first (value = event number), with an ``event_time`` column
    that restores event order."""
    return spark.range(0, rows, 1, partitions).selectExpr(
        "cast(id % 5 as string) AS key",
        f"cast({rows} - id as string) AS value",
        f"timestamp_seconds({rows} - id) AS event_time",
    )


def run_stream(spark: Session, source: Path, checkpoint: Path, fmt: str, **options: str) -> None:
    """Process every JSON file in ``source``, one file per micro-batch, then stop (or raise what the
    query raised)."""
    stream = (
        spark.readStream.schema("id LONG, key STRING")
        .option("maxFilesPerTrigger", 1)
        .json(str(source))
        .selectExpr("key", "CAST(id AS STRING) AS value")
    )
    query = (
        stream.writeStream.format(fmt)
        .option("checkpointLocation", str(checkpoint))
        .options(**options)
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()


def harvester_file(batches: Iterator[Any]) -> Iterator[Any]:
    """For ``mapInArrow``: where the Python worker imports this package from, once per row."""
    import harvester

    for batch in batches:
        yield pa.RecordBatch.from_pydict({"file": [str(harvester.__file__)] * batch.num_rows})

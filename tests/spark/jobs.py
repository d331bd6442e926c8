"""DataFrames and queries the Spark tests write, in the test process (local mode) or in a driver
submitted to the standalone cluster (shipped there with ``faults``): nothing here imports the tests'
own services."""

from __future__ import annotations

from pathlib import Path

from pyspark.sql import DataFrame, SparkSession


def numbered(spark: SparkSession, rows: int, partitions: int, keys: int = 7) -> DataFrame:
    """Rows 0..rows-1 spread over ``partitions`` in order; key = n % keys, value = n."""
    return spark.range(0, rows, 1, partitions).selectExpr(
        "cast(id % " + str(keys) + " as string) AS key", "cast(id as string) AS value", "id"
    )


def newest_first(spark: SparkSession, rows: int, partitions: int) -> DataFrame:
    """Each of 5 keys' events newest first (value = event number), with an ``event_time`` column
    that restores event order."""
    return spark.range(0, rows, 1, partitions).selectExpr(
        "cast(id % 5 as string) AS key",
        f"cast({rows} - id as string) AS value",
        f"timestamp_seconds({rows} - id) AS event_time",
    )


def run_stream(spark: SparkSession, source: Path, checkpoint: Path, fmt: str, **options: str) -> None:
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

"""Rows per second into an outbox table: the ``outbox`` Spark data source against two baselines.

    .venv/bin/python bench/spark_write.py [--rows 1000000] [--partitions 2] [--rounds 3] [--jdbc-rewrite]

Writers, each into a fresh goharvest-layout outbox in a throwaway schema, all with the same rows
(topic, key ``key-<n % 1000>``, a ~45 character JSON value):

- ``outbox``: ``df.write.format("outbox")``: parallel COPY into staging, then one COPY into the outbox
  in the commit transaction.
- ``copy-rows``: one connection, ``COPY … FROM STDIN`` fed row by row through psycopg (the rows are
  collected to the driver first, untimed).
- ``copy-csv``: one connection, ``COPY`` of CSV that Arrow wrote in C++ (collected and encoded untimed):
  what PostgreSQL alone can ingest on one connection.
- ``parallel``: each Spark task COPYs its partition straight into the outbox, joined into lines by
  the sink's encoder:
  no staging, not atomic, no order across partitions. Not a usable writer: the most any Spark writer
  gets into this table on this machine, where PostgreSQL and Spark share the cores.
- ``jdbc``: Spark's built-in JDBC writer with the PostgreSQL driver from Maven Central
  (``--jdbc-rewrite`` adds ``reWriteBatchedInserts=true`` to its URL).

The writers take turns, round after round, so that the machine's noise spreads over all of them;
the summary is each writer's median. Targets: ``outbox`` at least the COPY rate and at least 3x the
JDBC writer's. Needs the local services (``deploy/local/services.sh start``); prints figures only.
"""

from __future__ import annotations

import argparse
import io
import os
import statistics
import sys
import time
import uuid
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.csv as pcsv
from psycopg import sql
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harvester.postgres.identifiers import TableName
from harvester.postgres.migrations import migrate
from harvester.spark import register
from harvester.spark.encode import text_lines

PG_DSN = os.environ.get(
    "HARVESTER_TEST_PG_DSN", "host=127.0.0.1 port=5432 user=harvester password=local-dev-secret dbname=harvester"
)
JDBC_URL = "jdbc:postgresql://127.0.0.1:5432/harvester"
JDBC_DRIVER = "org.postgresql:postgresql:42.7.4"
COLUMNS = ["kafka_topic", "kafka_key", "kafka_value"]


def fresh_outbox(conn: psycopg.Connection[tuple[object, ...]], schema: str, name: str) -> TableName:
    """A new, empty, migrated outbox table."""
    table = TableName(schema, name)
    migrate(conn, table)
    return table


def count(conn: psycopg.Connection[tuple[object, ...]], table: TableName) -> int:
    """Rows in ``table``: every writer must have written all of them."""
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone()
    return int(str(row[0])) if row else 0


class ParallelCopyWriter(DataSourceArrowWriter):
    """Every task COPYs its rows into the table in its own transaction (the bench rows need no escapes)."""

    def __init__(self, dsn: str, table: str) -> None:
        self.dsn, self.table = dsn, table

    def write(self, iterator: Any) -> WriterCommitMessage:
        """COPY this partition."""
        copy = f"COPY {self.table} (kafka_topic, kafka_key, kafka_value) FROM STDIN"
        with psycopg.connect(self.dsn) as conn, conn.cursor().copy(copy) as pipe:
            for batch in iterator:
                pipe.write(text_lines([c.cast(pa.large_string()) for c in batch.columns]))
        return WriterCommitMessage()


class ParallelCopy(DataSource):
    """The ``parallel`` writer as a data source (options ``dsn`` and ``table``)."""

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return "bench_parallel_copy"

    def writer(self, schema: StructType, overwrite: bool) -> ParallelCopyWriter:
        """A writer for one job."""
        return ParallelCopyWriter(self.options["dsn"], self.options["table"])


Writer = Callable[[TableName], None]


def writers(df: Any, args: argparse.Namespace) -> dict[str, Writer]:
    """Every writer under test, by label: each writes all rows into the table it is given."""
    options = {"dsn": PG_DSN, "topic": "bench.orders", "keyColumn": "kafka_key", "valueColumn": "kafka_value"}
    # Collected and encoded untimed: the COPY baselines measure PostgreSQL's ingest alone.
    arrow = df.toArrow()
    tuples = list(zip(*(arrow.column(c).to_pylist() for c in COLUMNS), strict=True))
    buffer = io.BytesIO()
    pcsv.write_csv(arrow, buffer, pcsv.WriteOptions(include_header=False))
    data = buffer.getvalue()
    columns = sql.SQL("(kafka_topic, kafka_key, kafka_value)")

    def outbox(table: TableName) -> None:
        df.write.format("outbox").mode("append").options(**options, table=table.qualified).save()

    def copy_rows(table: TableName) -> None:
        copy = sql.SQL("COPY {} {} FROM STDIN").format(table.ident, columns)
        with psycopg.connect(PG_DSN) as c, c.cursor().copy(copy) as pipe:
            for row in tuples:
                pipe.write_row(row)

    def copy_csv(table: TableName) -> None:
        copy = sql.SQL("COPY {} {} FROM STDIN (FORMAT csv)").format(table.ident, columns)
        with psycopg.connect(PG_DSN) as c, c.cursor().copy(copy) as pipe:
            for start in range(0, len(data), 1 << 20):
                pipe.write(data[start : start + (1 << 20)])

    def parallel(table: TableName) -> None:
        df.write.format("bench_parallel_copy").mode("append").options(dsn=PG_DSN, table=table.quoted).save()

    found: dict[str, Writer] = {"outbox": outbox, "copy-rows": copy_rows, "copy-csv": copy_csv, "parallel": parallel}
    if not args.skip_jdbc:
        url = JDBC_URL + ("?reWriteBatchedInserts=true" if args.jdbc_rewrite else "")
        props = {"user": "harvester", "password": "harvester", "driver": "org.postgresql.Driver"}
        found["jdbc"] = lambda table: df.write.jdbc(url, table.qualified, "append", props)
    return found


def main() -> None:
    """Run every writer ``--rounds`` times, interleaved, and print the median rates side by side."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=2, help="Spark partitions (parallel COPY streams)")
    parser.add_argument("--rounds", type=int, default=3, help="each writer runs once per round")
    parser.add_argument("--jdbc-rewrite", action="store_true", help="reWriteBatchedInserts=true for the JDBC writer")
    parser.add_argument("--skip-jdbc", action="store_true")
    args = parser.parse_args()

    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench-spark-write")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "2g")
        .config("spark.jars.packages", JDBC_DRIVER)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    spark.dataSource.register(ParallelCopy)

    def frame(rows: int) -> Any:
        """The bench's rows, ``rows`` of them, in ``--partitions`` partitions."""
        return spark.range(0, rows, 1, args.partitions).selectExpr(
            "'bench.orders' AS kafka_topic",
            "concat('key-', id % 1000) AS kafka_key",
            "concat('{\"order\":', id, ',\"status\":\"created\",\"total\":42.5}') AS kafka_value",
        )

    df = frame(args.rows)
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    rates: dict[str, list[float]] = {}
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        try:
            # Untimed: starts a Python worker per core and compiles the DataFrame's code, as in a
            # long-running application; then every writer writes a few rows, in as many partitions
            # as the timed writes so that every Python worker has loaded what its writer needs.
            df.write.format("noop").mode("overwrite").save()
            for label, write in writers(frame(2000), args).items():
                write(fresh_outbox(conn, schema, f"warm_{label.replace('-', '_')}"))
            candidates = writers(df, args)
            for round_no in range(1, args.rounds + 1):
                for label, write in candidates.items():
                    table = fresh_outbox(conn, schema, f"{label.replace('-', '_')}_{round_no}")
                    conn.execute("CHECKPOINT")
                    begin = time.perf_counter()
                    write(table)
                    seconds = time.perf_counter() - begin
                    assert count(conn, table) == args.rows, label
                    conn.execute(sql.SQL("DROP TABLE {}").format(table.ident))
                    rate = args.rows / seconds
                    print(f"round {round_no} {label:10s} {seconds:6.2f} s = {rate:>9,.0f} rows/s", flush=True)
                    rates.setdefault(label, []).append(rate)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            spark.stop()
    median = {label: statistics.median(found) for label, found in rates.items()}
    print(f"\nmedian of {args.rounds} rounds, {args.rows:,d} rows:")
    for label, rate in median.items():
        print(f"  {label:10s} {rate:>9,.0f} rows/s")
    print(f"outbox / copy-rows   = {median['outbox'] / median['copy-rows']:.2f}x (target >= 1)")
    print(f"outbox / copy-csv    = {median['outbox'] / median['copy-csv']:.2f}x")
    print(f"parallel / copy-rows = {median['parallel'] / median['copy-rows']:.2f}x (ceiling of any Spark writer)")
    if "jdbc" in median:
        print(f"outbox / jdbc        = {median['outbox'] / median['jdbc']:.2f}x (target >= 3)")


if __name__ == "__main__":
    main()

"""Rows per second into an outbox table: the ``outbox`` Spark data source against two baselines; or,
with ``--sizes``, the cost of one large write while a harvester drains the same outbox.

    .venv/bin/python bench/spark_write.py [--rows 1000000] [--partitions 2] [--rounds 3] [--jdbc-rewrite]
    .venv/bin/python bench/spark_write.py --sizes 1000000,5000000 [--trickle 2000] [--drain-seconds 15]

``--sizes``: for each size, one ``outbox`` write into a fresh outbox that an embedded harvester
(default limits) drains while other rows trickle into it (``--trickle`` rows/s, 10 per
transaction). Prints the staging time (job start to commit start), the commit time, what the
harvester published during the commit and its longest pause between two acknowledgements then,
every statement seen waiting for a lock on the outbox (``pg_locks`` sampled every 50 ms), and the
harvester's drain rate of the committed write over the ``--drain-seconds`` after the commit.

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
import json
import os
import statistics
import sys
import tempfile
import threading
import time
import uuid
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pyarrow.csv as pcsv
from confluent_kafka.admin import AdminClient
from psycopg import sql
from pyspark.sql.datasource import DataSource, DataSourceArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from workload import fresh_topic, run_engine, stop

from harvester import Limits
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import migrate
from harvester.spark import OutboxDataSource, OutboxWriter, register
from harvester.spark.encode import text_lines

BOOTSTRAP = os.environ.get("HARVESTER_TEST_KAFKA", "127.0.0.1:9092")
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


class TimedWriter(OutboxWriter):
    """The ``outbox`` batch writer, writing its commit's start and end times into a file."""

    def __init__(self, writer: OutboxWriter, path: str) -> None:
        super().__init__(writer.plan)
        self.path = path

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        """Commit as usual, timed (runs in a Python worker of the driver, hence the file)."""
        began = time.time()
        super().commit(messages)
        Path(self.path).write_text(json.dumps({"began": began, "ended": time.time()}))


class TimedOutbox(OutboxDataSource):
    """``format("bench_timed_outbox")``: the ``outbox`` source plus the option ``timingFile``."""

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return "bench_timed_outbox"

    def writer(self, schema: StructType, overwrite: bool) -> TimedWriter:
        """The real writer, timed."""
        return TimedWriter(super().writer(schema, overwrite), self.options["timingFile"])


def trickle(table: TableName, topic: str, rate: float, done: threading.Event, committed: list[float]) -> None:
    """Insert 10-row transactions at ``rate`` rows/s until ``done``, noting each commit's time."""
    insert = sql.SQL(
        "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value)"
        " SELECT now(), %s, 'other-' || g, 'x' FROM generate_series(1, 10) g"
    ).format(table.ident)
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        next_at = time.monotonic()
        while not done.is_set():
            conn.execute(insert, (topic,))
            committed.append(time.time())
            next_at += 10 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))


def lock_waits(table: TableName, done: threading.Event, seen: list[tuple[float, str]]) -> None:
    """Every 50 ms, note each lock request on ``table`` that waits: when, and the waiting statement."""
    query = (
        "SELECT l.locktype || ' ' || l.mode || ': ' || left(a.query, 60) FROM pg_locks l"
        " JOIN pg_stat_activity a USING (pid) WHERE NOT l.granted AND l.relation = %s::regclass"
    )
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        while not done.is_set():
            seen.extend((time.time(), str(row[0])) for row in conn.execute(query, (table.quoted,)))
            time.sleep(0.05)


def at_size(
    spark: Any, conn: psycopg.Connection[tuple[object, ...]], schema: str, rows: int, args: argparse.Namespace
) -> None:
    """One write of ``rows`` rows while the harvester drains trickled rows; print what it cost."""
    table, topic = fresh_outbox(conn, schema, f"size_{rows}"), fresh_topic()
    df = spark.range(0, rows, 1, args.partitions).selectExpr(
        "concat('key-', id % 1000) AS key",
        'concat(\'{"order":\', id, \',"status":"created","total":42.5}\') AS value',
    )
    timing = Path(tempfile.mkdtemp()) / "commit.json"
    acked: dict[int, float] = {}
    engine, store = run_engine(table, Limits(), acked)
    done = threading.Event()
    committed: list[float] = []
    waits: list[tuple[float, str]] = []
    threads = [
        threading.Thread(target=trickle, args=(table, topic, args.trickle, done, committed)),
        threading.Thread(target=lock_waits, args=(table, done, waits)),
    ]
    try:
        for t in threads:
            t.start()
        time.sleep(2.0)  # the harvester is draining the trickle before the write starts
        started = time.time()
        df.write.format("bench_timed_outbox").mode("append").options(
            dsn=PG_DSN, table=table.qualified, topic=topic, timingFile=str(timing)
        ).save()
        commit = json.loads(timing.read_text())
        done.set()
        for t in threads:
            t.join()
        time.sleep(args.drain_seconds)
        window_end = time.time()
    finally:
        done.set()
        stop(engine, store)
        conn.execute(sql.SQL("DROP TABLE {} CASCADE").format(table.ident))
        AdminClient({"bootstrap.servers": BOOTSTRAP}).delete_topics([topic])
    # Acknowledgements are timestamped by the publisher: the trickled rows acked during the commit,
    # and afterwards the committed write's rows (the trickle stopped with the commit).
    during = sorted(t for t in acked.values() if commit["began"] <= t <= commit["ended"])
    after = sum(1 for t in acked.values() if commit["ended"] < t <= window_end)
    trickled = sum(1 for t in committed if commit["began"] <= t <= commit["ended"])
    pauses = [b - a for a, b in zip([commit["began"], *during], [*during, commit["ended"]], strict=True)]
    seconds = commit["ended"] - commit["began"]
    in_commit = sorted({what for at, what in waits if commit["began"] <= at <= commit["ended"]})
    elsewhere = sorted({what for at, what in waits} - set(in_commit))
    print(
        f"{rows:>9,d} rows: staging {commit['began'] - started:6.1f} s, commit {seconds:6.1f} s"
        f" ({rows / seconds:,.0f} rows/s)",
        flush=True,
    )
    print(
        f"           during the commit: {trickled:,d} other rows inserted ({trickled / seconds:,.0f}/s), the harvester"
        f" published {len(during):,d} rows, longest pause between its acks {max(pauses):.2f} s;"
        f" lock waits on the outbox: {in_commit or 'none'} (outside the commit: {elsewhere or 'none'})"
    )
    print(
        f"           harvester drain of the committed rows: {after / args.drain_seconds:,.0f} records/s"
        f" (over {args.drain_seconds:.0f} s)",
        flush=True,
    )


def sizes(args: argparse.Namespace) -> None:
    """The ``--sizes`` study."""
    os.environ["PYSPARK_PYTHON"] = sys.executable
    from pyspark.sql import SparkSession

    spark = (
        SparkSession.builder.master("local[2]")
        .appName("bench-spark-write-sizes")
        .config("spark.ui.enabled", "false")
        .config("spark.driver.memory", "2g")
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    spark.dataSource.register(TimedOutbox)
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        try:
            warm = fresh_outbox(conn, schema, "warm")
            small = spark.range(0, 2000, 1, args.partitions).selectExpr("cast(id as string) AS key", "'v' AS value")
            small.write.format("bench_timed_outbox").mode("append").options(
                dsn=PG_DSN, table=warm.qualified, topic="t", timingFile=os.devnull
            ).save()
            for rows in (int(n) for n in args.sizes.split(",")):
                at_size(spark, conn, schema, rows, args)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            spark.stop()


def main() -> None:
    """Run every writer ``--rounds`` times, interleaved, and print the median rates side by side."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--partitions", type=int, default=2, help="Spark partitions (parallel COPY streams)")
    parser.add_argument("--rounds", type=int, default=3, help="each writer runs once per round")
    parser.add_argument("--jdbc-rewrite", action="store_true", help="reWriteBatchedInserts=true for the JDBC writer")
    parser.add_argument("--skip-jdbc", action="store_true")
    parser.add_argument("--sizes", help="comma-separated write sizes: run the large-write study instead")
    parser.add_argument("--trickle", type=float, default=2000, help="--sizes: other rows/s inserted meanwhile")
    parser.add_argument("--drain-seconds", type=float, default=15, help="--sizes: how long to time the drain")
    args = parser.parse_args()
    if args.sizes:
        sizes(args)
        return

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
            'concat(\'{"order":\', id, \',"status":"created","total":42.5}\') AS kafka_value',
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

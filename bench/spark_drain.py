"""The Spark drain (``readStream.format("outbox")`` whose tasks publish what they read, or whose rows
go to the project's sink, ``outbox-publish``, or to Spark's Kafka sink) next to the reaper's drain of
the same backlog, in the same run.

    .venv/bin/python bench/spark_drain.py [--records 1000000] [--keys 1000] [--shards 1,2,4]
                                          [--max-records N] [--tasks-per-shard N]
                                          [--sink publish|outbox-publish|kafka] [--rounds 2]

For each round and number of shards S: the reaper's drain as ``bench/shards.py`` runs it (one
``reaper run`` process leading the S shards, default limits), then the Spark drain of an equal
backlog in a fresh outbox: a query in ``local[*]`` with Spark's default trigger (micro-batches back
to back), options as given (default: batches sized, one task per shard). Both are timed alike: the
relay runs and leads every shard, then the backlog is COPied in one transaction and timed from its
commit to the empty table. The Spark session is started once, and a drain of 100,000 records runs
first, unmeasured, so that its JIT-compiled code and Python workers are warm. With ``--sink
publish`` (the default) the source's tasks publish (``option("publish", "true")``, which joins the
outbox's leader group as a reaper does) and the rows go to Spark's ``noop`` sink. Spark's Kafka sink
gets the rows as they come, ``partition`` included (null: the source is not in a leader group then,
so no reaper places keys beside it). Prints records/s of each, the Spark drain's ratio to the
reaper's, and what each spent in CPU seconds per 1,000 records over its drain: the relay (the
``reaper run`` process; the Spark drain's JVM with its Python workers and this process, the
driver), PostgreSQL and the Kafka broker. On two cores shared by all three, a drain's rate is
bounded by their sum.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient
from cpu import CpuMeter, tree_seconds
from psycopg import sql
from pyspark.sql import SparkSession
from shards import drain as reaper_drain
from workload import BOOTSTRAP, DSN, copy_rows, fresh_topic

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.spark_pipeline import KAFKA_PACKAGE
from harvester import TableName, migrate
from harvester.postgres.schema.migrations import ensure_shard_index, fence_table
from harvester.spark import register

WARM_UP = 100_000
"""Records of the drain run first and not measured."""


def session() -> SparkSession:
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (
        SparkSession.builder.master("local[*]")
        .appName("bench-spark-drain")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "4")
        .config("spark.jars.packages", KAFKA_PACKAGE)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    return spark


def spark_drain(
    spark: SparkSession,
    conn: psycopg.Connection[Any],
    shards: int,
    records: int,
    keys: int,
    options: dict[str, str],
    sink: str,
) -> tuple[float, Cpu]:
    """Records/s of a Spark drain of a ``records`` backlog over ``shards`` shards, and its CPU: timed
    as the reaper's drain is, from the backlog's commit to the empty table, the query running and
    leading every shard before."""
    table = TableName(f"sparkbench_{uuid.uuid4().hex[:8]}", "outbox")
    migrate(conn, table)
    ensure_shard_index(conn, table, shards)
    topic = fresh_topic()
    probe = sql.SQL("SELECT 1 FROM {} LIMIT 1").format(table.ident)
    terms = sql.SQL("SELECT count(*) FROM {} WHERE outbox_table = %s").format(fence_table(table).ident)
    meter = CpuMeter(conn)
    with tempfile.TemporaryDirectory() as tmp:
        outbox = {"dsn": DSN, "table": table.qualified}
        source = {"shards": str(shards), **options}
        if sink == "publish":  # the tasks publish; in the leader group, as a reaper is
            source |= {"publish": "true", "kafka.bootstrap.servers": BOOTSTRAP}
        rows = spark.readStream.format("outbox").options(**outbox, **source).load()
        if sink == "kafka":  # Spark's Kafka sink takes these columns only
            rows = rows.selectExpr("topic", "key", "value", "headers", "partition")
        query = (
            rows.writeStream.format("noop" if sink == "publish" else sink)
            .options(**(outbox if sink == "outbox-publish" else {}))  # where dead letters go
            .option("kafka.bootstrap.servers", BOOTSTRAP)
            .option("checkpointLocation", str(Path(tmp) / "cp"))
            .start()  # micro-batches back to back, as long as there are records
        )
        try:
            deadline = time.monotonic() + 120
            while (conn.execute(terms, (table.qualified,)).fetchone() or (0,))[0] < shards:
                if time.monotonic() > deadline or query.exception() is not None:
                    raise RuntimeError(f"the query took no term of every shard: {query.exception()}")
                time.sleep(0.1)
            time.sleep(1.0)  # let the first (empty) plans settle, as the reaper's bench does
            conn.execute("CHECKPOINT")
            copy_rows(conn, table, topic, records, keys)  # visible at once, at its commit
            before, relay_before, started = meter.sample(), tree_seconds(os.getpid()), time.perf_counter()
            while conn.execute(probe).fetchone() is not None:
                if query.exception() is not None:
                    raise RuntimeError(f"the query failed: {query.exception()}")
                time.sleep(0.02)
            elapsed = time.perf_counter() - started
            after, relay_after = meter.sample(), tree_seconds(os.getpid())
        finally:
            query.stop()
    conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(str(table.schema))))
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})  # kept until its futures resolve
    group = f"outbox-harvester.{table.qualified}"
    gone = [topic, f"{group}.neli"] if sink == "publish" else [topic]
    for future in admin.delete_topics(gone).values():
        future.result(30)
    scale = 1000 / records
    relay = (relay_after - relay_before) * scale
    cpu = Cpu(relay, (after.postgres - before.postgres) * scale, (after.broker - before.broker) * scale)
    return records / elapsed, cpu


@dataclass(frozen=True, slots=True)
class Cpu:
    """CPU seconds per 1,000 records of one drain."""

    relay: float
    postgres: float
    broker: float

    def __str__(self) -> str:
        return f"{self.relay:.3f} / {self.postgres:.3f} / {self.broker:.3f}"


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000, help="backlog per drain")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--shards", default="1,2,4", help="comma-separated numbers of shards")
    p.add_argument(
        "--max-records", type=int, help="the Spark drain's maxRecordsPerTrigger (default: unset, batches sized)"
    )
    p.add_argument(
        "--sink",
        choices=("publish", "outbox-publish", "kafka"),
        default="publish",
        help="publish: the source's tasks publish (option publish, a noop sink); or the rows to outbox-publish"
        " or to Spark's Kafka sink",
    )
    p.add_argument("--tasks-per-shard", type=int, default=1, help="the source's tasksPerShard")
    p.add_argument("--rounds", type=int, default=2, help="runs of every number of shards")
    args = p.parse_args()
    options = {"tasksPerShard": str(args.tasks_per_shard)}
    if args.max_records:
        options["maxRecordsPerTrigger"] = str(args.max_records)
    spark = session()
    # Spark's JIT-compiled code and its Python workers warm, as in a query that has run a while.
    with psycopg.connect(DSN, autocommit=True) as conn:
        spark_drain(spark, conn, 1, WARM_UP, args.keys, options, args.sink)
    print(
        f"workload: backlogs of {args.records} records, {args.keys} keys; reaper default limits; Spark local[*],"
        f" sink {args.sink}, maxRecordsPerTrigger {args.max_records or 'unset'}, tasksPerShard"
        f" {args.tasks_per_shard}; {os.cpu_count()} cores;"
        f" load average {os.getloadavg()[0]:.1f}"
    )
    print(
        "round  shards  reaper records/s  Spark records/s  Spark / reaper"
        "  CPU s/1,000 reaper: relay / PostgreSQL / broker  Spark: relay / PostgreSQL / broker  load"
    )
    with psycopg.connect(DSN, autocommit=True) as conn:
        for round_ in range(1, args.rounds + 1):
            for shards in (int(n) for n in args.shards.split(",")):
                run = reaper_drain(conn, shards, 1, 1, args.records, args.keys)  # one process, one worker
                reaper = Cpu(run.cpu_reapers, run.cpu_postgres, run.cpu_broker)
                rate, spark_cpu = spark_drain(spark, conn, shards, args.records, args.keys, options, args.sink)
                print(
                    f"{round_:5d}  {shards:6d}  {run.rate:16.0f}  {rate:15.0f}  {rate / run.rate:14.2f}"
                    f"  {reaper!s:>47}  {spark_cpu!s:>35}  {os.getloadavg()[0]:4.1f}",
                    flush=True,
                )
    spark.stop()


if __name__ == "__main__":
    main()

"""The Spark drain (``readStream.format("outbox")`` into the project's sink, ``outbox-publish``, or
Spark's Kafka sink) next to the reaper's drain of the same backlog, in the same run.

    .venv/bin/python bench/spark_drain.py [--records 1000000] [--keys 1000] [--shards 1,2,4]
                                          [--max-records N] [--sink outbox-publish|kafka] [--rounds 2]

For each round and number of shards S: the reaper's drain as ``bench/shards.py`` runs it (one
``reaper run`` process leading the S shards, default limits; a backlog COPied in one transaction,
timed from its commit to the empty table), then the Spark drain of an equal backlog in a fresh
outbox: a ``Trigger.AvailableNow`` query in ``local[*]`` (one input partition per shard), timed from
the query's start to its end (the outbox empty; the Spark session is started once, before the first
run). Spark's Kafka sink gets the rows as they come, ``partition`` included (null: the source is not
in a leader group here, so no reaper places keys beside it). Prints records/s of each, the Spark
drain's ratio to the reaper's, and what each spent in CPU seconds per 1,000 records over its drain:
the relay (the ``reaper run`` process; the Spark drain's JVM with its Python workers and this
process, the driver), PostgreSQL and the Kafka broker. On two cores shared by all three, a drain's
rate is bounded by their sum.
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
from harvester.postgres.schema.migrations import ensure_shard_index
from harvester.spark import register


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
    max_records: int | None,
    sink: str,
) -> tuple[float, Cpu]:
    """Records/s of a Spark drain of a ``records`` backlog over ``shards`` shards, and its CPU."""
    table = TableName(f"sparkbench_{uuid.uuid4().hex[:8]}", "outbox")
    migrate(conn, table)
    ensure_shard_index(conn, table, shards)
    topic = fresh_topic()
    copy_rows(conn, table, topic, records, keys)
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table.ident))
    meter = CpuMeter(conn)
    with tempfile.TemporaryDirectory() as tmp:
        before, relay_before = meter.sample(), tree_seconds(os.getpid())
        started = time.perf_counter()
        outbox = {"dsn": DSN, "table": table.qualified}
        rows = (
            spark.readStream.format("outbox")
            .options(**outbox, shards=shards, **({"maxRecordsPerTrigger": max_records} if max_records else {}))
            .load()
        )
        if sink == "kafka":  # Spark's Kafka sink takes these columns only
            rows = rows.selectExpr("topic", "key", "value", "headers", "partition")
        query = (
            rows.writeStream.format(sink)
            .options(**(outbox if sink == "outbox-publish" else {}))  # where dead letters go
            .option("kafka.bootstrap.servers", BOOTSTRAP)
            .option("checkpointLocation", str(Path(tmp) / "cp"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        elapsed = time.perf_counter() - started
        after, relay_after = meter.sample(), tree_seconds(os.getpid())
    left = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone()
    if left != (0,):
        raise RuntimeError(f"the Spark drain left {left} records")
    conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(str(table.schema))))
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})  # kept until its futures resolve
    for future in admin.delete_topics([topic]).values():
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
    p.add_argument("--sink", choices=("outbox-publish", "kafka"), default="outbox-publish")
    p.add_argument("--rounds", type=int, default=2, help="runs of every number of shards")
    args = p.parse_args()
    spark = session()
    print(
        f"workload: backlogs of {args.records} records, {args.keys} keys; reaper default limits; Spark local[*],"
        f" sink {args.sink}, maxRecordsPerTrigger {args.max_records or 'unset'}; {os.cpu_count()} cores;"
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
                rate, spark_cpu = spark_drain(spark, conn, shards, args.records, args.keys, args.max_records, args.sink)
                print(
                    f"{round_:5d}  {shards:6d}  {run.rate:16.0f}  {rate:15.0f}  {rate / run.rate:14.2f}"
                    f"  {reaper!s:>47}  {spark_cpu!s:>35}  {os.getloadavg()[0]:4.1f}",
                    flush=True,
                )
    spark.stop()


if __name__ == "__main__":
    main()

"""The Spark drain (``readStream.format("outbox")`` into Spark's Kafka sink) next to the reaper's drain
of the same backlog, in the same run.

    .venv/bin/python bench/spark_drain.py [--records 1000000] [--keys 1000] [--shards 1,2,4]
                                          [--max-records 10000]

For each number of shards S: the reaper's drain as ``bench/shards.py`` runs it (one ``reaper run``
process leading the S shards, default limits; a backlog COPied in one transaction, timed from its
commit to the empty table), then the Spark drain of an equal backlog in a fresh outbox: a
``Trigger.AvailableNow`` query in ``local[*]`` (one input partition per shard), timed from the
query's start to its end (the outbox empty; the Spark session is started once, before the first
run). Prints records/s of each and the Spark drain's ratio to the reaper's.
"""

from __future__ import annotations

import argparse
import os
import sys
import tempfile
import time
import uuid
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient
from harvest import BOOTSTRAP, DSN, copy_rows, fresh_topic
from psycopg import sql
from pyspark.sql import SparkSession
from shards import drain as reaper_drain

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
    spark: SparkSession, conn: psycopg.Connection[Any], shards: int, records: int, keys: int, max_records: int
) -> float:
    """Records/s of a Spark drain of a ``records`` backlog over ``shards`` shards."""
    table = TableName(f"sparkbench_{uuid.uuid4().hex[:8]}", "outbox")
    migrate(conn, table)
    ensure_shard_index(conn, table, shards)
    topic = fresh_topic()
    copy_rows(conn, table, topic, records, keys)
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table.ident))
    with tempfile.TemporaryDirectory() as tmp:
        started = time.perf_counter()
        query = (
            spark.readStream.format("outbox")
            .option("dsn", DSN)
            .option("table", table.qualified)
            .option("shards", shards)
            .option("maxRecordsPerTrigger", max_records)
            .load()
            .selectExpr("topic", "key", "value", "headers")
            .writeStream.format("kafka")
            .option("kafka.bootstrap.servers", BOOTSTRAP)
            .option("checkpointLocation", str(Path(tmp) / "cp"))
            .trigger(availableNow=True)
            .start()
        )
        query.awaitTermination()
        elapsed = time.perf_counter() - started
    left = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone()
    if left != (0,):
        raise RuntimeError(f"the Spark drain left {left} records")
    conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(str(table.schema))))
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})  # kept until its futures resolve
    for future in admin.delete_topics([topic]).values():
        future.result(30)
    return records / elapsed


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000, help="backlog per drain")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--shards", default="1,2,4", help="comma-separated numbers of shards")
    p.add_argument("--max-records", type=int, default=10_000, help="the Spark drain's maxRecordsPerTrigger")
    args = p.parse_args()
    spark = session()
    print(
        f"workload: backlogs of {args.records} records, {args.keys} keys; reaper default limits; Spark local[*],"
        f" maxRecordsPerTrigger {args.max_records}; {os.cpu_count()} cores; load average {os.getloadavg()[0]:.1f}"
    )
    print("shards  reaper records/s  Spark records/s  Spark / reaper")
    with psycopg.connect(DSN, autocommit=True) as conn:
        for shards in (int(n) for n in args.shards.split(",")):
            reaper = reaper_drain(conn, shards, 1, 1, args.records, args.keys).rate  # one process, one worker
            spark_rate = spark_drain(spark, conn, shards, args.records, args.keys, args.max_records)
            print(f"{shards:6d}  {reaper:16.0f}  {spark_rate:15.0f}  {spark_rate / reaper:13.2f}", flush=True)
    spark.stop()


if __name__ == "__main__":
    main()

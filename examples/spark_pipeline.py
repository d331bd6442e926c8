"""Example pipeline: Kafka -> Spark Structured Streaming aggregation -> outbox -> harvester -> Kafka.

    .venv/bin/python examples/spark_pipeline.py                # on the local services
    .venv/bin/python examples/spark_pipeline.py --follow       # keep streaming until Ctrl-C

What it does, in one process:

1. creates the input and output topics (if absent) and the outbox table (``reaper migrate``'s work);
2. produces ``--events`` sample orders ``{"order": n, "customer": "c<k>", "amount": <cents>}``;
3. starts a :class:`harvester.Harvester` on the outbox, publishing to Kafka;
4. runs a streaming query: the Spark Kafka source (resolved from Maven Central through
   ``spark.jars.packages``) reads the orders, sums them per customer, and writes the totals to
   the outbox (``format("outbox")``, output mode ``complete``: Spark offers Python data sources
   append and complete, not update, so every micro-batch publishes all totals); in the same transaction a
   ``commitSql`` upsert keeps the business table ``<schema>.customer_totals`` in step;
5. waits until the harvester has published every record, then stops.

Without ``--follow`` the query processes what the input topic holds and stops (trigger
``availableNow``); run it again and it resumes from its checkpoint.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import tempfile
import time
from pathlib import Path

import psycopg
from confluent_kafka import Producer
from psycopg import sql
from pyspark.sql import SparkSession
from pyspark.sql import functions as f

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harvester import Harvester, HarvesterConfig
from harvester.kafka.topics import ensure_topic
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import migrate
from harvester.spark import register

# The newest Kafka connector on Maven Central; Spark 4.3 runs the 4.2 connector unchanged.
KAFKA_PACKAGE = os.environ.get("SPARK_KAFKA_PACKAGE", "org.apache.spark:spark-sql-kafka-0-10_2.13:4.2.0")
DEFAULT_DSN = "host=127.0.0.1 port=5432 user=harvester password=local-dev-secret dbname=harvester"


def order(n: int, customers: int) -> dict[str, int | str]:
    """The n-th sample order; deterministic, so a test can compute the expected totals."""
    return {"order": n, "customer": f"c{n % customers}", "amount": (n * 37) % 100 + 1}


def produce_orders(bootstrap: str, topic: str, events: int, customers: int) -> None:
    """Produce the first ``events`` sample orders to ``topic``."""
    producer = Producer({"bootstrap.servers": bootstrap})
    for n in range(events):
        body = order(n, customers)
        producer.produce(topic, key=str(body["customer"]).encode(), value=json.dumps(body).encode())
        producer.poll(0)
    if producer.flush(30):
        raise RuntimeError("could not deliver the sample orders")


def prepare_tables(dsn: str, table: TableName) -> sql.Composed:
    """Migrate the outbox and create the business table; return the commitSql upsert into it."""
    totals = TableName(table.schema, "customer_totals").ident
    with psycopg.connect(dsn, autocommit=True) as conn:
        migrate(conn, table)
        conn.execute(
            sql.SQL("CREATE TABLE IF NOT EXISTS {} (customer TEXT PRIMARY KEY, total BIGINT, orders BIGINT)").format(
                totals
            )
        )
    # outbox_batch is the sink's view of the rows being committed (see docs/spark.md).
    return sql.SQL(
        "INSERT INTO {t} (customer, total, orders)"
        " SELECT key, (value::jsonb ->> 'total')::bigint, (value::jsonb ->> 'orders')::bigint FROM outbox_batch"
        " ON CONFLICT (customer) DO UPDATE SET total = excluded.total, orders = excluded.orders"
    ).format(t=totals)


def pending(dsn: str, table: TableName) -> int:
    """Records the harvester has not yet published (it deletes what Kafka acknowledged)."""
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone()
        return int(str(row[0])) if row else 0


def parse_args(argv: list[str] | None = None) -> argparse.Namespace:
    """The command line (defaults: the local services)."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--bootstrap", default=os.environ.get("HARVESTER_TEST_KAFKA", "127.0.0.1:9092"))
    parser.add_argument("--dsn", default=os.environ.get("HARVESTER_TEST_PG_DSN", DEFAULT_DSN))
    parser.add_argument("--table", default="examples.outbox", help="outbox table (schema.table)")
    parser.add_argument("--input-topic", default="example.orders")
    parser.add_argument("--output-topic", default="example.customer-totals")
    parser.add_argument("--events", type=int, default=1000, help="sample orders to produce first (0: none)")
    parser.add_argument("--customers", type=int, default=10)
    parser.add_argument("--sink-id", default="example-customer-totals")
    parser.add_argument("--checkpoint", default=str(Path(tempfile.gettempdir()) / "outbox-example-checkpoint"))
    parser.add_argument("--follow", action="store_true", help="keep streaming (every 2 s) until Ctrl-C")
    parser.add_argument("--drain-timeout", type=float, default=60.0)
    return parser.parse_args(argv)


def spark_session() -> SparkSession:
    """A local session with the Kafka connector, resolved from Maven Central."""
    os.environ["PYSPARK_PYTHON"] = sys.executable  # the workers need harvester and its dependencies
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("outbox-example")
        .config("spark.jars.packages", KAFKA_PACKAGE)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "1")  # a handful of customers: one task is plenty
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("WARN")
    return spark


def stream_totals(spark: SparkSession, args: argparse.Namespace, table: TableName, upsert: sql.Composed) -> None:
    """The streaming query: orders from Kafka, totals per customer into the outbox."""
    register(spark)
    orders = (
        spark.readStream.format("kafka")
        .option("kafka.bootstrap.servers", args.bootstrap)
        .option("subscribe", args.input_topic)
        .option("startingOffsets", "earliest")
        .load()
        .select(f.from_json(f.col("value").cast("string"), "order LONG, customer STRING, amount LONG").alias("o"))
        .select("o.*")
    )
    totals = orders.groupBy("customer").agg(f.sum("amount").alias("total"), f.count("*").alias("orders"))
    records = totals.select(
        f.col("customer").alias("key"), f.to_json(f.struct("customer", "total", "orders")).alias("value")
    )
    writer = (
        records.writeStream.format("outbox")
        .outputMode("complete")
        .option("checkpointLocation", args.checkpoint)
        .option("dsn", args.dsn)
        .option("table", table.qualified)
        .option("topic", args.output_topic)
        .option("sinkId", args.sink_id)
        .option("commitSql", upsert.as_string())
    )
    trigger = writer.trigger(processingTime="2 seconds") if args.follow else writer.trigger(availableNow=True)
    query = trigger.start()
    try:
        query.awaitTermination()
    except KeyboardInterrupt:
        query.stop()


def run(spark: SparkSession, args: argparse.Namespace) -> None:
    """Set up, run the streaming query, wait for the harvester to publish everything, stop."""
    table = TableName.parse(args.table)
    for topic in (args.input_topic, args.output_topic):
        ensure_topic({"bootstrap.servers": args.bootstrap}, topic)
    upsert = prepare_tables(args.dsn, table)
    if args.events:
        produce_orders(args.bootstrap, args.input_topic, args.events, args.customers)
    harvester = Harvester(
        HarvesterConfig(
            data_source=args.dsn,
            outbox_table=table.qualified,
            base_kafka_config={"bootstrap.servers": args.bootstrap},
            leader_group_id=f"outbox-example.{table.qualified}",
        )
    )
    harvester.start()
    try:
        stream_totals(spark, args, table, upsert)
        deadline = time.monotonic() + args.drain_timeout
        while (left := pending(args.dsn, table)) and time.monotonic() < deadline:
            time.sleep(0.5)
    finally:
        harvester.stop()
    if left:
        raise SystemExit(f"{left} records still in {table} after {args.drain_timeout} s: is the harvester leading?")
    print(f"published every record to {args.output_topic}; totals in {table.schema or 'public'}.customer_totals")


def main() -> None:
    """The one-command example: a session of its own, the pipeline, then shut down."""
    args = parse_args()
    spark = spark_session()
    try:
        run(spark, args)
    finally:
        spark.stop()


if __name__ == "__main__":
    main()

"""A Spark driver of its own for the driver-kill test: drains an outbox into Kafka through the
project's sink, ``outbox-publish``, from a checkpoint, until killed.

    python -m tests.spark_drain.drain_job '<json: dsn, table, shards, max_records, bootstrap, checkpoint>'
"""

from __future__ import annotations

import json
import os
import sys

from pyspark.sql import SparkSession

from harvester.spark import register
from tests.spark.cluster import JAVA_OPTIONS, PYTHON_PATIENCE


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("drain-job")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.driver.extraJavaOptions", JAVA_OPTIONS)  # it runs for seconds: start it cheaply
        .config(*PYTHON_PATIENCE)
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    outbox = {"dsn": spec["dsn"], "table": spec["table"]}
    writer = (
        spark.readStream.format("outbox")
        .options(**outbox, shards=spec["shards"], maxRecordsPerTrigger=spec["max_records"])
        .load()
        .writeStream.format("outbox-publish")
        .options(**outbox, checkpointLocation=spec["checkpoint"])
        .option("kafka.bootstrap.servers", spec["bootstrap"])
    )
    query = writer.trigger(processingTime="200 milliseconds").start()
    print("started", flush=True)
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()

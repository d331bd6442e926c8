"""A Spark driver of its own for the driver-kill test: drains an outbox into Kafka through Spark's
Kafka sink from a checkpoint, until killed.

    python -m tests.spark_drain.drain_job '<json: dsn, table, shards, max_records, bootstrap, checkpoint>'
"""

from __future__ import annotations

import json
import os
import sys

from pyspark.sql import SparkSession

from examples.spark_pipeline import KAFKA_PACKAGE
from harvester.spark import register
from tests.spark.cluster import JAVA_OPTIONS


def main() -> None:
    spec = json.loads(sys.argv[1])
    os.environ["PYSPARK_PYTHON"] = sys.executable
    spark = (
        SparkSession.builder.master("local[2]")
        .appName("drain-job")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.jars.packages", KAFKA_PACKAGE)
        .config("spark.driver.extraJavaOptions", JAVA_OPTIONS)  # it runs for seconds: start it cheaply
        .getOrCreate()
    )
    spark.sparkContext.setLogLevel("ERROR")
    register(spark)
    writer = (
        spark.readStream.format("outbox")
        .option("dsn", spec["dsn"])
        .option("table", spec["table"])
        .option("shards", spec["shards"])
        .option("maxRecordsPerTrigger", spec["max_records"])
        .load()
        .selectExpr("topic", "key", "value", "headers")
        .writeStream.format("kafka")
        .option("kafka.bootstrap.servers", spec["bootstrap"])
        .option("checkpointLocation", spec["checkpoint"])
    )
    query = writer.trigger(processingTime="200 milliseconds").start()
    print("started", flush=True)
    query.awaitTermination()
    spark.stop()


if __name__ == "__main__":
    main()

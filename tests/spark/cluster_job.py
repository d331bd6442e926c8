"""The drivers the cluster tests submit to the standalone cluster, with the recipes docs/spark.md gives:

    spark-submit --master spark://… --py-files outbox_harvester.zip,testkit.zip cluster_job.py serve CONFIG
    PYSPARK_PYTHON=./environment/bin/python spark-submit --master spark://… --archives env.tar.gz#environment \
        --py-files testkit.zip cluster_job.py stream CONFIG

``serve`` is one long-lived driver that runs, one after the other, the scenarios the tests drop into
its inbox directory as ``<name>.json`` files (``{"scenario": …, "config": …}``), writing each result
as ``<name>.result`` (JSON; ``{"error": …}`` if the scenario raised): one driver and one set of
executors for every test that does not kill its driver, instead of one each. ``CONFIG`` is JSON:
the DSN, the tables and directories of the scenario, and ``result``, a file where the driver writes
what the test checks besides the tables (JSON).
"""

from __future__ import annotations

import json
import sys
import time
import traceback
from collections.abc import Callable, Iterable, Iterator
from pathlib import Path
from typing import Any

from pyspark.sql import SparkSession

from harvester.spark import register
from tests.spark import faults
from tests.spark.jobs import newest_first, numbered, run_stream

Config = dict[str, Any]


def _harvester_file(_: Iterable[int]) -> Iterator[str]:
    import harvester

    yield str(harvester.__file__)


def batch(spark: SparkSession, config: Config) -> dict[str, Any]:
    """A retried task, a job that fails, ``orderColumn``, ``commitSql``: each into its own table."""
    sink = {"dsn": config["dsn"], "faultDir": config["faults"]}
    imported = spark.sparkContext.parallelize(range(4), 4).mapPartitions(_harvester_file).collect()
    # Partition 1's first attempt stages its rows, then fails; Spark retries it.
    numbered(spark, 4000, 4).write.format("outbox_faulty").mode("append").options(
        **sink, table=config["retried"], topic="orders", faultAt="stage", faultPartition="1", faultAttempt="0"
    ).save()
    failed = ""
    try:  # every attempt of partition 1 fails after staging: the job aborts
        numbered(spark, 1000, 3).write.format("outbox_faulty").mode("append").options(
            **sink, table=config["failed"], topic="orders", faultAt="stage", faultPartition="1"
        ).save()
    except Exception as error:
        failed = str(error)
    newest_first(spark, 600, 3).write.format("outbox").mode("append").options(
        dsn=config["dsn"], table=config["ordered"], topic="events", orderColumn="event_time"
    ).save()
    for _ in range(2):
        numbered(spark, 70, 2).write.format("outbox").mode("append").options(
            dsn=config["dsn"], table=config["business"], topic="t", commitSql=config["commitSql"]
        ).save()
    return {"imported": imported, "failed": failed}


def stream(spark: SparkSession, config: Config) -> dict[str, Any]:
    """Phase ``crash``: batch 1's commit fails before the database; after a query restart, batch 2's
    commit reaches the database and hangs there until the test kills this driver. Phase ``finish``:
    a new driver picks the query up from the checkpoint."""
    options = {
        "dsn": config["dsn"],
        "table": config["table"],
        "topic": "counts",
        "sinkId": config["sinkId"],
        "faultDir": config["faults"],
    }
    source, checkpoint = Path(config["source"]), Path(config["checkpoint"])
    if config["phase"] == "finish":
        run_stream(spark, source, checkpoint, "outbox", **options)
        return {}
    imported = spark.sparkContext.parallelize(range(2), 2).mapPartitions(_harvester_file).collect()
    failed = ""
    try:
        run_stream(spark, source, checkpoint, "outbox_faulty", **options, faultAt="commitBefore", faultBatch="1")
    except Exception as error:
        failed = str(error)
    Path(config["result"]).write_text(json.dumps({"failed": failed, "imported": imported}))
    held = {"faultAt": "commitAfter", "faultBatch": "2", "faultHold": "1"}
    run_stream(spark, source, checkpoint, "outbox_faulty", **options, **held)
    raise AssertionError("the held commit returned: the test was to kill this driver")


def lost(spark: SparkSession, config: Config) -> dict[str, Any]:
    """A write whose first attempts hold while the test kills a worker."""
    numbered(spark, config["rows"], 4).write.format("outbox_faulty").mode("append").options(
        dsn=config["dsn"], table=config["table"], topic="orders", faultAt="hold", faultDir=config["faults"]
    ).save()
    return {}


def drain(spark: SparkSession, config: Config) -> dict[str, Any]:
    """Drain an outbox into Kafka through Spark's Kafka sink (``Trigger.AvailableNow``), one read
    holding while the test kills its executor (its faulty reader hands Spark batches of a few rows,
    so that the held task's first records leave its Python worker before it holds)."""
    bootstrap = {"kafka.bootstrap.servers": config["bootstrap"]}
    options = {"dsn": config["dsn"], "table": config["table"], "shards": "2", **bootstrap}
    faulty = {"faultAt": "read", "faultPartition": "0", "faultBatch": "3", "faultDir": config["faults"]}
    records = spark.readStream.format("outbox_faulty").options(
        **options, **faulty, maxRecordsPerTrigger="200", leaderGroupID=config["group"]
    )
    query = (
        records.load()
        .selectExpr("topic", "key", "value", "headers", "partition")
        .writeStream.format("kafka")
        .options(**bootstrap, checkpointLocation=config["checkpoint"])
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return {}


def publish(spark: SparkSession, config: Config) -> dict[str, Any]:
    """Drain an outbox (``Trigger.AvailableNow``, from the checkpoint) through the project's own sink,
    ``outbox-publish``, selecting no column."""
    outbox = {"dsn": config["dsn"], "table": config["table"]}
    # A missing topic is known as such after a second, instead of librdkafka's 30.
    kafka = {"kafka.bootstrap.servers": config["bootstrap"], "kafka.topic.metadata.propagation.max.ms": "1000"}
    records = spark.readStream.format("outbox").options(**outbox, shards="2", maxRecordsPerTrigger="200").load()
    query = (
        records.writeStream.format("outbox-publish")
        .options(**outbox, **kafka, checkpointLocation=config["checkpoint"])
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination()
    return {}


SCENARIOS: dict[str, Callable[[SparkSession, Config], dict[str, Any]]] = {
    "batch": batch,
    "stream": stream,
    "lost": lost,
    "drain": drain,
    "publish": publish,
}


def serve(spark: SparkSession, config: Config) -> dict[str, Any]:
    """Run the scenarios dropped into ``config["inbox"]`` until a file ``stop`` appears there."""
    inbox = Path(config["inbox"])
    while not (inbox / "stop").exists():
        for request in sorted(inbox.glob("*.json")):
            job = json.loads(request.read_text())
            request.unlink()
            try:
                result = SCENARIOS[job["scenario"]](spark, job["config"])
            except Exception:
                result = {"error": traceback.format_exc()}
            done = request.with_suffix(".tmp")
            done.write_text(json.dumps(result))
            done.rename(request.with_suffix(".result"))
        time.sleep(0.1)
    return {}


def main(scenario: str, config: Config) -> None:
    """Run ``scenario`` on the cluster this driver was submitted to."""
    spark = SparkSession.builder.appName(f"harvester-tests-{scenario}").getOrCreate()
    spark.sparkContext.setLogLevel("WARN")
    register(spark)
    spark.dataSource.register(faults.FaultyOutbox)
    result = {**SCENARIOS, "serve": serve}[scenario](spark, config)
    Path(config["result"]).write_text(json.dumps(result))
    spark.stop()


if __name__ == "__main__":
    main(sys.argv[1], json.loads(sys.argv[2]))

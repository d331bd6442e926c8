"""Spark integration: the ``outbox`` data source, which writes DataFrames into the outbox atomically.

from harvester.spark import register
register(spark)
df.write.format("outbox").mode("append").option("dsn", dsn).option("topic", "orders").save()
"""

from __future__ import annotations

from typing import TYPE_CHECKING

from pyspark.sql import SparkSession

from harvester.spark.drain import kafka_sink
from harvester.spark.plan import SinkConfigError
from harvester.spark.publish import OutboxPublishDataSource
from harvester.spark.source import OutboxDataSource, OutboxStreamWriter, OutboxWriter, StagedPartition

if TYPE_CHECKING:  # the Connect client needs pyspark's `connect` extra, so it is never imported here
    from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

__all__ = [
    "OutboxDataSource",
    "OutboxPublishDataSource",
    "OutboxStreamWriter",
    "OutboxWriter",
    "SinkConfigError",
    "StagedPartition",
    "register",
]


def register(spark: SparkSession | RemoteSparkSession) -> None:
    """Make ``format("outbox")`` and ``format("outbox-publish")`` available in ``spark``, a classic or
    a Spark Connect session (Python data sources are registered per session), and make Spark's
    Kafka sink refuse the drain's rows without their ``partition`` column (``drain/kafka_sink.py``)."""
    kafka_sink.install()
    spark.dataSource.register(OutboxDataSource)
    spark.dataSource.register(OutboxPublishDataSource)

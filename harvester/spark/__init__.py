"""Spark integration: the ``outbox`` data source, which writes DataFrames into the outbox atomically.

    from harvester.spark import register
    register(spark)
    df.write.format("outbox").mode("append").option("dsn", dsn).option("topic", "orders").save()
"""

from __future__ import annotations

from pyspark.sql import SparkSession

from harvester.spark.plan import SinkConfigError
from harvester.spark.source import OutboxDataSource, OutboxStreamWriter, OutboxWriter, StagedPartition

__all__ = ["OutboxDataSource", "OutboxStreamWriter", "OutboxWriter", "SinkConfigError", "StagedPartition", "register"]


def register(spark: SparkSession) -> None:
    """Make ``format("outbox")`` available in ``spark`` (Python data sources are registered per session)."""
    spark.dataSource.register(OutboxDataSource)

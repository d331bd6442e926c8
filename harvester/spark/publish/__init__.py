"""The drain's own Kafka sink: ``writeStream.format("outbox-publish")`` publishes the rows of
``readStream.format("outbox")`` with the reaper's producer and dead-letters what Kafka refuses, see
``docs/spark.md``."""

from harvester.spark.publish.options import PublishOptions
from harvester.spark.publish.sink import OutboxPublishDataSource, OutboxPublishWriter, Published

__all__ = ["OutboxPublishDataSource", "OutboxPublishWriter", "PublishOptions", "Published"]

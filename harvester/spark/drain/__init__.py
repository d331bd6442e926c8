"""Harvesting with Spark micro-batches: ``spark.readStream.format("outbox")`` drains an outbox table
(mark-purge/reset as a streaming source), see ``docs/spark.md``."""

from harvester.spark.drain.options import DrainConfigError, DrainOptions
from harvester.spark.drain.reader import OutboxStreamReader
from harvester.spark.drain.schema import DRAIN_SCHEMA, PUBLISHED_SCHEMA
from harvester.spark.drain.task import ShardBatch

__all__ = ["DRAIN_SCHEMA", "PUBLISHED_SCHEMA", "DrainConfigError", "DrainOptions", "OutboxStreamReader", "ShardBatch"]

"""The options of the ``outbox`` streaming source, checked on the driver before anything runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from harvester.core.identity import DEFAULT_PREFIX
from harvester.postgres.schema.identifiers import TableName
from harvester.spark.drain.sizing import MOST
from harvester.spark.options import DEFAULT_MAX_ATTEMPTS, DrainConfigError, flag, outbox_of, positive

__all__ = ["DEFAULT_MAX_RECORD_BYTES", "DrainConfigError", "DrainOptions"]

DEFAULT_MAX_RECORD_BYTES = 1_048_576
"""``max.request.size`` of the Java producer, and so of Spark's Kafka sink, unless it sets another."""


@dataclass(frozen=True, slots=True)
class DrainOptions:
    """What a drain of one outbox needs; plain values, pickled to every executor."""

    dsn: str
    table: TableName
    shards: int
    # Per micro-batch, over all shards (``maxRecordsPerTrigger``); unset, batches are sized
    # (:mod:`harvester.spark.drain.sizing`) up to its most.
    max_records: int
    sized: bool
    max_record_bytes: int  # the largest record the sink sends (its ``max.request.size``)
    header_prefix: str
    producer_name: str | None
    # Kafka properties (the ``kafka.``-prefixed options, prefix removed): with ``bootstrap.servers``
    # the query joins the reapers' leader group and harvests only the shards it leads.
    kafka: dict[str, str]
    group_id: str
    leader_topic: str
    # ``publish``: the tasks publish what they read (with ``kafka``'s brokers) and yield one row each
    # (:data:`harvester.spark.drain.schema.PUBLISHED_SCHEMA`), dead-lettering after ``max_attempts``.
    publish: bool
    max_attempts: int
    # Tasks reading (and publishing) each shard's records of a batch, each the keys of one hash.
    tasks_per_shard: int

    @property
    def elected(self) -> bool:
        """Whether the query competes for the shards in the leader group (else it takes them all)."""
        return "bootstrap.servers" in self.kafka

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> DrainOptions:
        """Options as Spark passes them (case-insensitive keys); raises :class:`DrainConfigError`."""
        lowered = {k.lower(): v for k, v in options.items()}
        dsn, table = outbox_of(lowered, "a libpq connection string")
        group = lowered.get("leadergroupid") or f"outbox-harvester.{table.qualified}"
        kafka = {k.removeprefix("kafka."): v for k, v in lowered.items() if k.startswith("kafka.")}
        publish = flag(lowered, "publish")
        if publish and "bootstrap.servers" not in kafka:
            raise DrainConfigError("option publish needs kafka.bootstrap.servers: the brokers to publish to")
        return cls(
            dsn=dsn,
            table=table,
            shards=positive(lowered, "shards", 1),
            max_records=positive(lowered, "maxRecordsPerTrigger", MOST),
            sized="maxrecordspertrigger" not in lowered,
            max_record_bytes=positive(lowered, "maxRecordBytes", DEFAULT_MAX_RECORD_BYTES),
            header_prefix=lowered.get("headerprefix", DEFAULT_PREFIX),
            producer_name=lowered.get("producername") or None,
            kafka=kafka,
            # The reaper's defaults (harvester.config), so that a drain and the outbox's reapers meet.
            group_id=group,
            leader_topic=lowered.get("leadertopic") or f"{group}.neli",
            publish=publish,
            max_attempts=positive(lowered, "maxAttempts", DEFAULT_MAX_ATTEMPTS),
            tasks_per_shard=positive(lowered, "tasksPerShard", 1),
        )

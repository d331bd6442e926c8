"""The options of the ``outbox-publish`` sink, checked on the driver before anything runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from harvester.core.identity import DEFAULT_PREFIX
from harvester.postgres.schema.identifiers import TableName
from harvester.spark.options import DEFAULT_MAX_ATTEMPTS, DrainConfigError, outbox_of, positive


@dataclass(frozen=True, slots=True)
class PublishOptions:
    """What the sink's tasks and its commit need; plain values, pickled to every executor."""

    dsn: str
    table: TableName
    kafka: dict[str, str]  # producer properties: the ``kafka.``-prefixed options, prefix removed
    max_attempts: int
    header_prefix: str

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> PublishOptions:
        """Options as Spark passes them (case-insensitive keys); raises :class:`DrainConfigError`."""
        lowered = {k.lower(): v for k, v in options.items()}
        dsn, table = outbox_of(lowered, "the outbox's libpq connection string, for dead letters")
        kafka = {k.removeprefix("kafka."): v for k, v in lowered.items() if k.startswith("kafka.")}
        if "bootstrap.servers" not in kafka:
            raise DrainConfigError("option kafka.bootstrap.servers is required: the brokers to publish to")
        return cls(
            dsn=dsn,
            table=table,
            kafka=kafka,
            max_attempts=positive(lowered, "maxAttempts", DEFAULT_MAX_ATTEMPTS),
            header_prefix=lowered.get("headerprefix", DEFAULT_PREFIX),
        )

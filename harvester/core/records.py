"""Outbox records: what applications write (:class:`OutboxRecord`) and what the engine marks
(:class:`MarkedRecord`)."""

from __future__ import annotations

import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import datetime
from typing import Any, Literal, Self

from pydantic import BaseModel, ConfigDict, model_validator

from harvester.core.identity import Stamp

# Kafka's own rule for topic names (org.apache.kafka.common.internals.Topic).
_TOPIC = re.compile(r"^[A-Za-z0-9._-]{1,249}$")

ValueKind = Literal["text", "bytes", "json"]


class RecordError(ValueError):
    """A record cannot be written to the outbox as it stands."""


def check_topic(topic: str) -> None:
    """Raise :class:`RecordError` unless Kafka would accept ``topic`` as a topic name."""
    if not _TOPIC.match(topic) or topic in (".", ".."):
        raise RecordError(f"invalid Kafka topic name {topic!r}: 1-249 characters of letters, digits, '.', '_' or '-'")


@dataclass(frozen=True, slots=True)
class ColumnLimits:
    """What the outbox table's columns accept, read from the catalog (:mod:`harvester.postgres.schema.catalog`);
    the defaults are goharvest's layout."""

    key_max_chars: int | None = 100
    value_max_chars: int | None = 10000
    value_kind: ValueKind = "text"


class OutboxRecord(BaseModel):
    """One message an application wants published, validated before it touches the database.

    ``value=None`` publishes a tombstone. Headers are two parallel lists, as in the table; use
    :meth:`of` to build a record from a mapping or from (key, value) pairs.
    """

    model_config = ConfigDict(frozen=True, strict=True)

    topic: str
    key: str
    value: str | bytes | None = None
    header_keys: tuple[str, ...] = ()
    header_values: tuple[str, ...] = ()

    @model_validator(mode="after")
    def _check(self) -> Self:
        check_topic(self.topic)
        if len(self.header_keys) != len(self.header_values):
            raise RecordError(f"{len(self.header_keys)} header keys but {len(self.header_values)} header values")
        if "\x00" in self.key or any("\x00" in h for h in (*self.header_keys, *self.header_values)):
            raise RecordError("keys and headers must not contain NUL characters")
        return self

    @classmethod
    def of(
        cls,
        topic: str,
        key: str,
        value: str | bytes | None = None,
        headers: Mapping[str, str] | Iterable[tuple[str, str]] = (),
    ) -> OutboxRecord:
        """Build a record from a header mapping or a sequence of (key, value) pairs."""
        pairs = list(headers.items()) if isinstance(headers, Mapping) else list(headers)
        return cls(
            topic=topic,
            key=key,
            value=value,
            header_keys=tuple(k for k, _ in pairs),
            header_values=tuple(v for _, v in pairs),
        )

    def with_headers(self, pairs: Iterable[tuple[str, str]]) -> OutboxRecord:
        """A copy with ``pairs`` appended to the headers (validated like a new record)."""
        pairs = list(pairs)
        return self.model_validate(
            {
                **self.model_dump(),
                "header_keys": (*self.header_keys, *(k for k, _ in pairs)),
                "header_values": (*self.header_values, *(v for _, v in pairs)),
            }
        )

    def check_limits(self, limits: ColumnLimits) -> None:
        """Raise :class:`RecordError` if the record does not fit the table's columns."""
        if limits.key_max_chars is not None and len(self.key) > limits.key_max_chars:
            raise RecordError(f"key has {len(self.key)} characters; the column allows {limits.key_max_chars}")
        value = self.value
        if value is None:
            return
        if limits.value_kind == "bytes":
            return
        if isinstance(value, bytes):
            try:
                value = value.decode("utf-8")
            except UnicodeDecodeError as exc:
                raise RecordError("value is not valid UTF-8 and the value column is textual") from exc
        if "\x00" in value:
            raise RecordError("a textual value column cannot hold NUL characters")
        if limits.value_max_chars is not None and len(value) > limits.value_max_chars:
            raise RecordError(f"value has {len(value)} characters; the column allows {limits.value_max_chars}")

    def column_value(self, limits: ColumnLimits) -> Any:
        """The value as the table's value column stores it (bytes for BYTEA, text otherwise)."""
        if self.value is None:
            return None
        if limits.value_kind == "bytes":
            return self.value.encode("utf-8") if isinstance(self.value, str) else self.value
        return self.value.decode("utf-8") if isinstance(self.value, bytes) else self.value


@dataclass(slots=True)
class MarkedRecord:
    """A record the current leader has marked and may publish.

    ``value`` and header values are already encoded as the bytes Kafka will carry. ``headers``
    are the row's own; ``stamp``, when set, adds the identity headers after them (see
    :meth:`kafka_headers`). ``attempts`` counts earlier permanent failures; ``malformed`` says why
    the row cannot be published at all.
    """

    id: int
    create_time: datetime
    topic: str
    key: str
    value: bytes | None
    headers: list[tuple[str, str | bytes | None]]
    attempts: int = 0
    first_failure: datetime | None = None
    malformed: str | None = None
    stamp: Stamp | None = None

    def kafka_headers(self) -> list[tuple[str, str | bytes | None]]:
        """The headers the record is published with: its own, then its identity headers."""
        return self.headers if self.stamp is None else [*self.headers, *self.stamp.headers(self.id)]


@dataclass(frozen=True, slots=True)
class Failure:
    """A permanent delivery failure of one record, as the store records it."""

    id: int
    key: str
    reason: str
    error: str
    attempts: int
    first_failure: datetime | None


@dataclass(slots=True)
class PlacedRecord(MarkedRecord):
    """A record with a Kafka timestamp or partition of its own, as Debezium's ``EventRouter`` takes
    them from columns (``table.field.event.timestamp``, a ``partition`` placement). Only the layouts
    that place records make these, and only the placing publishers read the fields, so no other
    record costs anything more.

    ``timestamp`` is in milliseconds since the epoch, 0 leaving it to the producer (its clock);
    ``partition`` -1 leaves it to the partitioner.
    """

    timestamp: int = 0
    partition: int = -1


def placement(record: MarkedRecord) -> tuple[int, int]:
    """A record's own timestamp and partition, (0, -1) for one not placed (:class:`PlacedRecord`)."""
    return (record.timestamp, record.partition) if isinstance(record, PlacedRecord) else (0, -1)

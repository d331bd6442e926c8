"""The largest record Kafka takes, so that the drain dead-letters a record Kafka would refuse
instead of failing its micro-batch on every replay.

Spark's Kafka sink fails the whole batch when Kafka refuses one record, and the replay sends the
same records again: one record too large would stall the query for good (a reaper dead-letters it,
its delivery failing with a permanent error). Kafka refuses a record by its size: the producer's
``max.request.size`` and the topic's ``max.message.bytes``. Both are compared with the size of the
record's batch, which the Java producer bounds from above by a batch header, a record header and
the lengths of the key, the value and each header with their varints. The plan's estimate
(``harvester.postgres.table.rows.Pending.size`` plus :func:`overhead`) takes every varint and number at its
widest, so it is never below that bound: a record either check refuses is always caught (with an
uncompressed sink, Spark's default, for the broker's), and one a few hundred bytes below the limit
may be caught too.
"""

from __future__ import annotations

import time
from collections.abc import Mapping

from confluent_kafka.admin import AdminClient, ConfigResource, ResourceType  # type: ignore[attr-defined]

from harvester.core.identity import IdentityHeaders

_BATCH_HEADER = 61  # a record batch's header (magic 2)
_RECORD_HEADER = 21  # a record's attributes, timestamp and offset deltas and lengths, at most
_VARINTS = 10  # a header's two length varints, at most
_DECIMAL = 20  # digits of a 64-bit id, epoch or batch number, and a sign
_TOPIC_CONFIG_TTL = 60.0  # seconds a topic's max.message.bytes is trusted


def overhead(names: IdentityHeaders, producer: str) -> int:
    """Bytes a record's published batch adds to its key, value and row headers (counted with their
    varints): the batch and record headers and the identity headers the drain adds."""
    numbers = (names.id, names.epoch, names.batch, names.previous)
    identity = sum(len(n) + _DECIMAL for n in numbers) + len(names.producer) + len(producer.encode())
    return _BATCH_HEADER + _RECORD_HEADER + identity + _VARINTS * (len(numbers) + 1)


class RecordLimits:
    """Per topic, the largest record the sink can publish: ``max_record_bytes`` (the sink's
    ``max.request.size``), and, when the query has Kafka options, no more than the topic's
    ``max.message.bytes`` (looked up at most once a minute per topic)."""

    def __init__(self, max_record_bytes: int, kafka: Mapping[str, str] | None) -> None:
        self._max = max_record_bytes
        self._admin = AdminClient(dict(kafka)) if kafka else None
        self._topics: dict[str, tuple[float, int | None]] = {}

    def limit(self, topic: str) -> tuple[int, str]:
        """The largest record ``topic`` takes, and which setting says so."""
        found = self._topic_limit(topic)
        if found is not None and found < self._max:
            return found, f"max.message.bytes of topic {topic}"
        return self._max, "maxRecordBytes (the sink's max.request.size)"

    def _topic_limit(self, topic: str) -> int | None:
        if self._admin is None:
            return None
        now = time.monotonic()
        cached = self._topics.get(topic)
        if cached is not None and now - cached[0] < _TOPIC_CONFIG_TTL:
            return cached[1]
        value: int | None = None
        resource = ConfigResource(ResourceType.TOPIC, topic)
        try:
            configs = self._admin.describe_configs([resource], request_timeout=10)[resource].result(timeout=15)
            value = int(configs["max.message.bytes"].value)
        except Exception:  # no such topic (yet), or not allowed to look: the sink's own limit
            value = None
        self._topics[topic] = (now, value)
        return value

"""The Kafka partition a reaper would send a record to, so that a key's records stay in one partition
whichever harvester, a reaper or a Spark drain, publishes them.

A reaper's producer (librdkafka) places a keyed record by ``crc32(key) % partitions`` (its default
``consistent_random`` partitioner); Spark's Kafka sink, left to itself, by Java's murmur2. So the
drain names the partition in its ``partition`` column, which Spark's Kafka sink honours."""

from __future__ import annotations

import zlib
from collections.abc import Mapping

from confluent_kafka.admin import AdminClient


class Placement:
    """Partitions of the topics one executor task writes to, looked up once per topic."""

    def __init__(self, kafka: Mapping[str, str]) -> None:
        self._admin = AdminClient(dict(kafka))
        self._counts: dict[str, int] = {}

    def partition(self, topic: str, key: str | None) -> int | None:
        """The partition of ``key`` in ``topic``; None (the sink's choice) for an empty key, which a
        reaper places at random, or a topic that does not exist yet."""
        if not key:
            return None
        count = self._counts.get(topic)
        if count is None:
            found = self._admin.list_topics(topic=topic, timeout=30).topics.get(topic)
            if found is None or found.error is not None or not found.partitions:
                return None
            count = self._counts[topic] = len(found.partitions)
        return zlib.crc32(key.encode("utf-8")) % count

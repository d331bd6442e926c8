"""The topics the harvester needs: created when absent with :func:`ensure_topic` (defined in
:mod:`leader.topic`, which creates the leader topic with it and imports nothing of the harvester),
and the partitions a sharded checkpoint topic must have."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka.admin import AdminClient

from leader.topic import ensure_topic

__all__ = ["TopicError", "ensure_topic", "require_partitions"]


class TopicError(RuntimeError):
    """A topic the harvester needs exists in a shape it cannot use."""


def require_partitions(client_config: Mapping[str, Any], topic: str, partitions: int, timeout: float = 30.0) -> None:
    """Raise :class:`TopicError` unless ``topic`` has at least ``partitions`` partitions."""
    found = AdminClient(dict(client_config)).list_topics(topic=topic, timeout=timeout).topics.get(topic)
    have = len(found.partitions) if found is not None and found.error is None else 0
    if have < partitions:
        raise TopicError(
            f"topic {topic!r} has {have} partition{'s' if have != 1 else ''}, {partitions} shards need {partitions}: "
            "add partitions (docs/sharding.md)"
        )

"""Creating a topic the harvester needs when it is absent (leader, checkpoint and demo topics)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic


def ensure_topic(
    client_config: Mapping[str, Any],
    topic: str,
    *,
    partitions: int = 1,
    config: Mapping[str, str] | None = None,
    timeout: float = 30.0,
) -> bool:
    """Create ``topic`` unless it exists; True if this call created it.

    A topic created concurrently by another process counts as existing. Raises ``KafkaException``
    when the cluster cannot be asked or refuses the creation."""
    admin = AdminClient(dict(client_config))
    found = admin.list_topics(topic=topic, timeout=timeout).topics.get(topic)
    if found is not None and found.error is None:
        return False
    new = NewTopic(topic, num_partitions=partitions, replication_factor=-1, config=dict(config or {}))
    try:
        admin.create_topics([new], request_timeout=timeout)[topic].result(timeout)
    except KafkaException as exc:
        if exc.args[0].code() == KafkaError.TOPIC_ALREADY_EXISTS:
            return False
        raise
    return True


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

"""The topics the harvester needs: created when absent with :func:`ensure_topic` (defined in
:mod:`leader.topic`, which creates the leader topic with it and imports nothing of the harvester),
and the partitions a sharded checkpoint topic must have."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient

from leader.topic import ensure_topic

__all__ = ["KafkaUnreachableError", "TopicError", "ensure_checkpoints", "ensure_topic", "require_partitions"]

# What a look-up or creation ends with when no broker answered (as opposed to one that refused).
_UNREACHABLE = {KafkaError._TRANSPORT, KafkaError._TIMED_OUT, KafkaError._ALL_BROKERS_DOWN, KafkaError._RESOLVE}


class TopicError(RuntimeError):
    """A topic the harvester needs exists in a shape it cannot use, or could not be created."""


class KafkaUnreachableError(RuntimeError):
    """No broker at ``servers`` answered while the harvester looked up or created a topic it needs."""

    def __init__(self, servers: str, reason: str) -> None:
        super().__init__(f"Kafka unreachable at {servers}: {reason}")
        self.servers, self.reason = servers, reason


def ensure_checkpoints(client_config: Mapping[str, Any], topic: str, shards: int, timeout: float = 30.0) -> None:
    """Create the exactly-once checkpoint topic unless it exists, and check its partitions (one per
    shard). Raises :class:`KafkaUnreachableError` when no broker answered (a start then fails as
    with the leader topic: Kafka unreachable, started again later), :class:`TopicError` otherwise."""
    try:
        ensure_topic(client_config, topic, partitions=shards, timeout=timeout)
        if shards > 1:
            require_partitions(client_config, topic, shards, timeout)
    except KafkaException as exc:
        err: KafkaError = exc.args[0]
        if err.code() in _UNREACHABLE:
            raise KafkaUnreachableError(str(client_config.get("bootstrap.servers", "?")), err.str()) from exc
        raise TopicError(f"topic {topic!r} could not be created or looked up: {err.str()}") from exc


def require_partitions(client_config: Mapping[str, Any], topic: str, partitions: int, timeout: float = 30.0) -> None:
    """Raise :class:`TopicError` unless ``topic`` has at least ``partitions`` partitions."""
    found = AdminClient(dict(client_config)).list_topics(topic=topic, timeout=timeout).topics.get(topic)
    have = len(found.partitions) if found is not None and found.error is None else 0
    if have < partitions:
        raise TopicError(
            f"topic {topic!r} has {have} partition{'s' if have != 1 else ''}, {partitions} shards need {partitions}: "
            "add partitions (docs/sharding.md)"
        )

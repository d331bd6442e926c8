"""The leader topic: one partition per shard, created at start when allowed (with a retention that
keeps heartbeats an hour for inspection), otherwise required to exist with the right partitions.

:func:`ensure_topic`, the creation of any topic that is absent, lives here because the elector needs it
and :mod:`leader` imports nothing of :mod:`harvester`; the harvester's checkpoint topic uses it too
(through :mod:`harvester.kafka.topics`)."""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

import structlog
from confluent_kafka import KafkaError, KafkaException
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from leader.config import ElectorConfig

log = structlog.get_logger("leader")

_HOUR_MS = str(3_600_000)


class LeaderTopicError(RuntimeError):
    """The leader topic is missing and could not (or must not) be created."""


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


def ensure_leader_topic(config: ElectorConfig, client: dict[str, Any]) -> None:
    """Create the leader topic if it is missing and ``create_topic`` allows it, else check it, through
    a client of settings ``client``. Raises :class:`LeaderTopicError`."""
    if not config.create_topic:
        _require_topic(config, client)
        return
    try:
        # Heartbeats are worthless after seconds; keep an hour for inspection.
        hour = {"retention.ms": _HOUR_MS, "segment.ms": _HOUR_MS}
        created = ensure_topic(
            client, config.topic, partitions=config.partitions, config=hour, timeout=config.startup_timeout
        )
    except KafkaException as e:
        err: KafkaError = e.args[0]
        raise LeaderTopicError(
            f"leader topic {config.topic!r} does not exist and could not be created ({err.str()}); "
            f"create it with {_partitions(config.partitions)}, or allow this client to create topics"
        ) from e
    if created:
        log.info("leader_topic_created", topic=config.topic, partitions=config.partitions)
    else:
        _require_topic(config, client)


def _require_topic(config: ElectorConfig, client: dict[str, Any]) -> None:
    c = config
    try:
        meta = AdminClient(client).list_topics(topic=c.topic, timeout=c.startup_timeout)
    except KafkaException as e:
        raise LeaderTopicError(f"cannot look up leader topic {c.topic!r}: {e.args[0].str()}") from e
    found = meta.topics.get(c.topic)
    if found is None or found.error is not None:
        raise LeaderTopicError(
            f"leader topic {c.topic!r} does not exist and create_topic is off; create it ({_partitions(c.partitions)})"
        )
    # One partition per shard: with fewer, some shard would have no leader; with more (and
    # shards), a member could be given only partitions that lead nothing.
    have = len(found.partitions)
    if have < c.partitions or (c.partitions > 1 and have != c.partitions):
        raise LeaderTopicError(
            f"leader topic {c.topic!r} has {have} partition{'s' if have != 1 else ''} but {c.partitions} "
            f"shard{'s' if c.partitions != 1 else ''} need {_partitions(c.partitions)}: "
            "use another leader topic (see docs/sharding.md)"
        )


def _partitions(count: int) -> str:
    return "one partition" if count == 1 else f"{count} partitions"

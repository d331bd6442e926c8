"""The settings of the election's Kafka clients: a consumer in the leader group and a producer of
heartbeats. The election's own properties are set after the shared base config, so that a base shared
with other clients (the harvester's producer) cannot change how the election behaves."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import structlog
from confluent_kafka import KafkaError, TopicPartition

from leader.config import ElectorConfig

log = structlog.get_logger("leader")


def ms(seconds: float) -> int:
    """``seconds`` as librdkafka's whole milliseconds, at least 1."""
    return max(1, round(seconds * 1000))


def common_config(config: ElectorConfig) -> dict[str, Any]:
    """The base config of every client of the election (and of its admin look-ups)."""
    conf = {"client.id": f"neli-{config.name}", **config.kafka_config}
    conf.setdefault("error_cb", _log_kafka_error)
    return conf


def consumer_config(
    config: ElectorConfig, on_commit: Callable[[KafkaError | None, list[TopicPartition]], None]
) -> dict[str, Any]:
    """The group member's settings; ``on_commit`` hears how each membership probe's commit ended."""
    return {
        **common_config(config),
        "group.id": config.group_id,
        # The classic protocol lets the client choose session and heartbeat timing (KIP-848 does not).
        "group.protocol": "classic",
        "session.timeout.ms": ms(config.session_timeout),
        "heartbeat.interval.ms": ms(config.group_heartbeat_interval),
        "max.poll.interval.ms": ms(config.max_poll_interval),
        # Sticky: a standby joining or leaving does not take partition 0 away from the leader.
        "partition.assignment.strategy": "cooperative-sticky",
        # Offsets are the elector's business; these win over a base config shared with other clients.
        "enable.auto.commit": False,
        "enable.auto.offset.store": False,
        "auto.offset.reset": "latest",
        "on_commit": on_commit,
    }


def producer_config(config: ElectorConfig) -> dict[str, Any]:
    """The heartbeat producer's settings."""
    return {
        **common_config(config),
        # Set after kafka_config: a heartbeat must be durable and prompt whatever the shared base says.
        "acks": "all",
        "linger.ms": 0,
        # A heartbeat older than the timeout proves nothing; do not let it linger in the queue.
        "message.timeout.ms": ms(config.heartbeat_timeout),
    }


def _log_kafka_error(err: KafkaError) -> None:
    # librdkafka retries everything but fatal errors by itself (and logs to stderr): keep those quiet.
    (log.error if err.fatal() else log.info)("kafka_error", error=str(err))

"""The settings of a :class:`leader.election.NeliElector`, validated: the election's limits must fit
together (a leader cut off from the cluster fences itself before the coordinator can expel it) and
with librdkafka's, and the Kafka properties the election decides are its own."""

from __future__ import annotations

import os
import socket
from typing import Any

from pydantic import BaseModel, ConfigDict, Field, PositiveInt, model_validator

# Properties that decide the election; the typed ElectorConfig fields set them, so kafka_config must not.
MANAGED_KAFKA_KEYS = frozenset(
    {
        "group.id",
        "group.instance.id",
        "group.protocol",
        "session.timeout.ms",
        "heartbeat.interval.ms",
        "max.poll.interval.ms",
        "partition.assignment.strategy",
        "on_commit",
    }
)


class ElectorConfig(BaseModel):
    """Settings of a :class:`NeliElector`; durations are in seconds.

    Failover time after a crash is about ``session_timeout`` plus one rebalance; after a graceful
    :meth:`NeliElector.close` it is about ``group_heartbeat_interval`` plus one rebalance (``docs/leader.md``).
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    kafka_config: dict[str, Any] = Field(
        default_factory=lambda: {"bootstrap.servers": "127.0.0.1:9092"},
        description="librdkafka properties (bootstrap, security, ...) for the consumer, producer and admin client.",
    )
    group_id: str = Field(min_length=1, description="Consumer group of the competing processes.")
    topic: str = Field(default="", description="Leader topic; default '<group_id>.neli'.")
    heartbeat_interval: float = Field(default=1.0, gt=0, description="How often the leader publishes a heartbeat.")
    heartbeat_timeout: float = Field(
        default=5.0, gt=0, description="Without an own heartbeat read back for this long, the leader fences itself."
    )
    min_poll_interval: float = Field(default=0.1, gt=0, description="Shortest time between two polls.")
    max_poll_interval: float = Field(
        default=300.0,
        gt=0,
        description="Kafka's max.poll.interval.ms; also bounds how long a LeaderRevoked handler may block.",
    )
    session_timeout: float = Field(
        default=10.0,
        gt=0,
        description="Kafka's session.timeout.ms: how long the coordinator waits before expelling a silent member.",
    )
    group_heartbeat_interval: float = Field(
        default=1.0, gt=0, description="Kafka's heartbeat.interval.ms: how soon members learn of a rebalance."
    )
    create_topic: bool = Field(default=True, description="Create the leader topic (one partition) when absent.")
    startup_timeout: float = Field(default=30.0, gt=0, description="Bound on the topic check in start().")
    name: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        min_length=1,
        description="This member's name in heartbeats, client ids and logs.",
    )
    poll_batch: PositiveInt = Field(default=100, description="Most messages handled per poll.")
    partitions: PositiveInt = Field(
        default=1, description="Partitions of the leader topic: one election (shard) per partition."
    )

    @model_validator(mode="before")
    @classmethod
    def _default_topic(cls, data: Any) -> Any:
        if isinstance(data, dict) and not data.get("topic") and data.get("group_id"):
            return {**data, "topic": f"{data['group_id']}.neli"}
        return data

    @model_validator(mode="after")
    def _consistent(self) -> ElectorConfig:
        clash = sorted(MANAGED_KAFKA_KEYS & self.kafka_config.keys())
        if clash:
            raise ValueError(f"kafka properties {clash} are set by the elector; use the ElectorConfig fields")
        if self.heartbeat_interval >= self.heartbeat_timeout:
            raise ValueError("heartbeat_interval must be shorter than heartbeat_timeout")
        if self.min_poll_interval > self.heartbeat_interval:
            raise ValueError("min_poll_interval must not exceed heartbeat_interval")
        if self.group_heartbeat_interval >= self.session_timeout:
            raise ValueError("group_heartbeat_interval must be shorter than session_timeout")
        if self.heartbeat_timeout + self.group_heartbeat_interval >= self.session_timeout:
            # A leader cut off from the cluster must fence itself before the coordinator can expel it
            # (at the earliest one group heartbeat interval short of the session timeout) and hand over.
            raise ValueError("heartbeat_timeout + group_heartbeat_interval must be shorter than session_timeout")
        if self.max_poll_interval < self.session_timeout:
            raise ValueError("max_poll_interval must not be shorter than session_timeout (librdkafka requires it)")
        if self.min_poll_interval >= self.max_poll_interval:
            raise ValueError("min_poll_interval must be shorter than max_poll_interval")
        return self

"""Leadership events an elector emits to its listener.

Each event names the shard it concerns: the partition of the leader topic whose owner leads it
(always 0 when the topic has one partition, as in plain NELI)."""

from __future__ import annotations

from dataclasses import dataclass
from uuid import UUID


@dataclass(frozen=True, slots=True)
class LeaderAcquired:
    """This process became leader. ``leader_id`` is fresh and never reused."""

    leader_id: UUID
    shard: int = 0


@dataclass(frozen=True, slots=True)
class LeaderRevoked:
    """Leadership is being handed over (rebalance or close).

    The listener may block to wrap up in-flight work: the partition is released after it returns.
    """

    leader_id: UUID
    shard: int = 0


@dataclass(frozen=True, slots=True)
class LeaderFenced:
    """Heartbeats stopped arriving: assume another process may lead now, and stop leader work at once.

    The listener must not block.
    """

    leader_id: UUID
    shard: int = 0


LeaderEvent = LeaderAcquired | LeaderRevoked | LeaderFenced


@dataclass(frozen=True, slots=True)
class LeaderStatus:
    """A snapshot of an elector's view, for metrics, logs and readiness."""

    is_leader: bool
    leader_id: UUID | None
    seconds_since_heartbeat: float | None

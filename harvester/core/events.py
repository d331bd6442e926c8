"""Events a :class:`harvester.Harvester` reports to its event handler."""

from __future__ import annotations

from dataclasses import dataclass, field
from uuid import UUID

from leader.events import LeaderAcquired, LeaderFenced, LeaderRevoked


@dataclass(frozen=True, slots=True)
class LeaderRefreshed:
    """The engine replaced its leader id after a delivery failure or a mark error (a forced remark)."""

    leader_id: UUID
    previous: UUID
    shard: int = 0


@dataclass(frozen=True, slots=True)
class MeterRead:
    """A periodic snapshot of the engine's counters (every ``min_metrics_interval``)."""

    stats: dict[str, float] = field(default_factory=dict)


Event = LeaderAcquired | LeaderRefreshed | LeaderRevoked | LeaderFenced | MeterRead

__all__ = ["Event", "LeaderAcquired", "LeaderFenced", "LeaderRefreshed", "LeaderRevoked", "MeterRead"]

"""Leader election for competing harvesters: Fast NELI over a Kafka consumer group.

Names are imported on first use, so code that needs only the events (:mod:`leader.events`) does not
load the Kafka client.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from leader.config import ElectorConfig
    from leader.election import NeliElector
    from leader.events import LeaderAcquired, LeaderEvent, LeaderFenced, LeaderRevoked, LeaderStatus
    from leader.topic import LeaderTopicError

_EXPORTS = {
    "ElectorConfig": "leader.config",
    "LeaderAcquired": "leader.events",
    "LeaderEvent": "leader.events",
    "LeaderFenced": "leader.events",
    "LeaderRevoked": "leader.events",
    "LeaderStatus": "leader.events",
    "LeaderTopicError": "leader.topic",
    "NeliElector": "leader.election",
}

__all__ = [
    "ElectorConfig",
    "LeaderAcquired",
    "LeaderEvent",
    "LeaderFenced",
    "LeaderRevoked",
    "LeaderStatus",
    "LeaderTopicError",
    "NeliElector",
]


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'leader' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value
    return value

"""Leader election for competing harvesters: Fast NELI over a Kafka consumer group."""

from leader.election import ElectorConfig, LeaderTopicError, NeliElector
from leader.events import LeaderAcquired, LeaderEvent, LeaderFenced, LeaderRevoked, LeaderStatus

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

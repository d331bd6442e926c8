"""Transactional outbox harvester for PostgreSQL and Apache Kafka.

Applications write :class:`OutboxRecord` s in their own transactions (see :mod:`harvester.stasher`);
a :class:`Harvester` drains the outbox into Kafka with mark-purge/reset while it leads its group.
"""

from harvester.config import HarvesterConfig, Limits
from harvester.dedup import DedupReader, DedupState
from harvester.engine import Engine
from harvester.events import Event, LeaderAcquired, LeaderFenced, LeaderRefreshed, LeaderRevoked, MeterRead
from harvester.harvester import Harvester
from harvester.identifiers import IdentifierError, TableName
from harvester.migrations import migrate
from harvester.record import ColumnLimits, MarkedRecord, OutboxRecord, RecordError
from harvester.stasher import Stasher, stash
from harvester.store import OutboxMissingError, PostgresStore, StoreError

__version__ = "0.1.0"

__all__ = [
    "ColumnLimits",
    "DedupReader",
    "DedupState",
    "Engine",
    "Event",
    "Harvester",
    "HarvesterConfig",
    "IdentifierError",
    "LeaderAcquired",
    "LeaderFenced",
    "LeaderRefreshed",
    "LeaderRevoked",
    "Limits",
    "MarkedRecord",
    "MeterRead",
    "OutboxMissingError",
    "OutboxRecord",
    "PostgresStore",
    "RecordError",
    "Stasher",
    "StoreError",
    "TableName",
    "__version__",
    "migrate",
    "stash",
]

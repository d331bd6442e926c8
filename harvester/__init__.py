"""Transactional outbox harvester for PostgreSQL and Apache Kafka.

Applications write :class:`OutboxRecord` s in their own transactions with a :class:`Stasher` or an
:class:`AsyncStasher` (:mod:`harvester.client`); a :class:`Harvester` drains the outbox into Kafka
with mark-purge/reset while it leads its group. The package's layers are described in ``docs/architecture.md``.

Names are imported on first use, so an application that only stashes records never loads the
engine, confluent-kafka, pyspark or opentelemetry.
"""

from __future__ import annotations

from importlib import import_module
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harvester.client.async_stasher import AsyncStasher
    from harvester.client.dedup import DedupReader
    from harvester.client.dedup_state import DedupState
    from harvester.client.message_stasher import AsyncMessageStasher, MessageStasher
    from harvester.client.stasher import Stasher, stash
    from harvester.config import HarvesterConfig
    from harvester.core.engine import Engine
    from harvester.core.events import Event, LeaderAcquired, LeaderFenced, LeaderRefreshed, LeaderRevoked, MeterRead
    from harvester.core.limits import Limits
    from harvester.core.records import ColumnLimits, MarkedRecord, OutboxRecord, RecordError
    from harvester.harvester import Harvester
    from harvester.postgres.schema.catalog import OutboxMissingError
    from harvester.postgres.schema.identifiers import IdentifierError, TableName
    from harvester.postgres.schema.migrations import migrate
    from harvester.postgres.table.store import PostgresStore, StoreError

# The one place the version is written: pyproject.toml reads it ([tool.setuptools.dynamic]), so do
# keep it a plain string literal.
__version__ = "0.1.0"

# Public name -> the module that defines it.
_EXPORTS = {
    "AsyncMessageStasher": "harvester.client.message_stasher",
    "AsyncStasher": "harvester.client.async_stasher",
    "ColumnLimits": "harvester.core.records",
    "DedupReader": "harvester.client.dedup",
    "DedupState": "harvester.client.dedup_state",
    "Engine": "harvester.core.engine",
    "Event": "harvester.core.events",
    "Harvester": "harvester.harvester",
    "HarvesterConfig": "harvester.config",
    "IdentifierError": "harvester.postgres.schema.identifiers",
    "LeaderAcquired": "harvester.core.events",
    "LeaderFenced": "harvester.core.events",
    "LeaderRefreshed": "harvester.core.events",
    "LeaderRevoked": "harvester.core.events",
    "Limits": "harvester.core.limits",
    "MarkedRecord": "harvester.core.records",
    "MessageStasher": "harvester.client.message_stasher",
    "MeterRead": "harvester.core.events",
    "OutboxMissingError": "harvester.postgres.schema.catalog",
    "OutboxRecord": "harvester.core.records",
    "PostgresStore": "harvester.postgres.table.store",
    "RecordError": "harvester.core.records",
    "Stasher": "harvester.client.stasher",
    "StoreError": "harvester.postgres.table.store",
    "TableName": "harvester.postgres.schema.identifiers",
    "migrate": "harvester.postgres.schema.migrations",
    "stash": "harvester.client.stasher",
}

__all__ = [
    "AsyncMessageStasher",
    "AsyncStasher",
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
    "MessageStasher",
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


def __getattr__(name: str) -> Any:
    module = _EXPORTS.get(name)
    if module is None:
        raise AttributeError(f"module 'harvester' has no attribute {name!r}")
    value = getattr(import_module(module), name)
    globals()[name] = value  # later look-ups skip this function
    return value


def __dir__() -> list[str]:
    return sorted([*globals(), *_EXPORTS])

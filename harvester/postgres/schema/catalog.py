"""What an outbox table looks like, read from PostgreSQL's catalog in one query.

The store, the stashers, the Spark sink and ``reaper check`` all learn the table's shape here, by
the same rules: which value type it holds (and so how values are encoded), how long keys and values
may be, whether the header columns have defaults, and whether the optional attempt columns exist.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

import psycopg

from harvester.core.protocols import StoreError
from harvester.core.records import ColumnLimits, ValueKind
from harvester.postgres.schema.identifiers import TableName

__all__ = ["CATALOG_SQL", "OutboxColumns", "OutboxMissingError", "UnsupportedOutboxError", "columns_from_rows", "read"]


class OutboxMissingError(StoreError):
    """The configured outbox table does not exist."""


class UnsupportedOutboxError(StoreError):
    """The table exists but is not an outbox table this harvester can use."""


# One row per relevant column; one parameter: the table's quoted name (for to_regclass).
CATALOG_SQL = """
SELECT a.attname, t.typname, a.atttypmod, a.atthasdef
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped
  AND a.attname IN ('kafka_key', 'kafka_value', 'kafka_header_keys', 'kafka_header_values',
                    'harvest_attempts', 'harvest_first_failure', 'harvest_last_error')
"""

# kafka_value types the harvester supports, and how it treats their values.
_VALUE_KINDS: dict[str, ValueKind] = {
    "varchar": "text",
    "text": "text",
    "bpchar": "text",
    "json": "json",
    "jsonb": "json",
    "bytea": "bytes",
}
_BOUNDED_TEXT = ("varchar", "bpchar")
_ATTEMPT_COLUMNS = {"harvest_attempts", "harvest_first_failure", "harvest_last_error"}
_HEADER_COLUMNS = {"kafka_header_keys", "kafka_header_values"}


@dataclass(frozen=True, slots=True)
class OutboxColumns:
    """The outbox table's shape."""

    limits: ColumnLimits
    # PostgreSQL type names of kafka_key and kafka_value (the latter one of the supported ones).
    key_type: str
    value_type: str
    # Both header columns have defaults, so a write without headers may leave them out (goharvest's
    # own layout declares them NOT NULL without one).
    header_defaults: bool
    # harvest_attempts, harvest_first_failure and harvest_last_error exist (``reaper migrate``).
    tracks_attempts: bool

    def type_of(self, column: str) -> str:
        """``kafka_key`` or ``kafka_value``'s type as SQL spells it, for messages."""
        if column == "kafka_value":
            typname, length = self.value_type, self.limits.value_max_chars
        else:
            typname, length = self.key_type, self.limits.key_max_chars
        return f"{typname}({length})" if length is not None else typname


def _max_chars(typname: str, typmod: int) -> int | None:
    # For varchar(n) and char(n) the type modifier is n + 4; -1 means unbounded.
    return typmod - 4 if typname in _BOUNDED_TEXT and typmod >= 4 else None


def columns_from_rows(table: TableName, rows: Sequence[Sequence[Any]]) -> OutboxColumns:
    """Turn :data:`CATALOG_SQL`'s rows into :class:`OutboxColumns`."""
    if not rows:
        raise OutboxMissingError(f"outbox table {table} does not exist (run 'reaper migrate')")
    found = {str(r[0]): (str(r[1]), int(r[2])) for r in rows}
    defaults = {str(r[0]) for r in rows if r[3]}
    if not {"kafka_key", "kafka_value"} <= set(found):
        raise UnsupportedOutboxError(f"{table} lacks kafka_key or kafka_value; is it an outbox table?")
    value_type, value_mod = found["kafka_value"]
    kind = _VALUE_KINDS.get(value_type)
    if kind is None:
        raise UnsupportedOutboxError(
            f"unsupported kafka_value type {value_type!r} in {table}: use varchar, text, jsonb or bytea"
        )
    return OutboxColumns(
        limits=ColumnLimits(
            key_max_chars=_max_chars(*found["kafka_key"]),
            value_max_chars=_max_chars(value_type, value_mod),
            value_kind=kind,
        ),
        key_type=found["kafka_key"][0],
        value_type=value_type,
        header_defaults=defaults >= _HEADER_COLUMNS,
        tracks_attempts=set(found) >= _ATTEMPT_COLUMNS,
    )


def read(conn: psycopg.Connection[Any], table: TableName) -> OutboxColumns:
    """Read ``table``'s shape; raises :class:`OutboxMissingError` or :class:`UnsupportedOutboxError`."""
    return columns_from_rows(table, conn.execute(CATALOG_SQL, (table.quoted,)).fetchall())

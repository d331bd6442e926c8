"""Writing outbox records inside the application's own transaction.

The application passes its open connection (psycopg) or connection/session (SQLAlchemy); the
records commit or roll back with the rest of its transaction. Every record is validated against
the table's columns before anything is sent to the database.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from harvester.core.records import ColumnLimits, OutboxRecord
from harvester.postgres import catalog
from harvester.postgres.identifiers import TableName

if TYPE_CHECKING:
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.orm import Session

_COLUMNS = "create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values"
# Above this many records a COPY beats a multi-row INSERT.
_COPY_THRESHOLD = 50


class Stasher:
    """Writes :class:`OutboxRecord` s into one outbox table; caches the table's column limits."""

    def __init__(self, table: str | TableName = "outbox", limits: ColumnLimits | None = None) -> None:
        self.table = table if isinstance(table, TableName) else TableName.parse(table)
        self._limits = limits

    def _checked(self, records: Iterable[OutboxRecord], limits: ColumnLimits) -> list[tuple[Any, ...]]:
        rows = []
        for r in records:
            r.check_limits(limits)
            rows.append((r.topic, r.key, r.column_value(limits), list(r.header_keys), list(r.header_values)))
        return rows

    def stash(self, conn: psycopg.Connection[Any], records: OutboxRecord | Sequence[OutboxRecord]) -> int:
        """Insert records with a psycopg connection, in its current transaction; return the count.

        Many records go through one COPY, a few through one multi-row INSERT.
        """
        batch = [records] if isinstance(records, OutboxRecord) else list(records)
        if not batch:
            return 0
        if self._limits is None:
            self._limits = catalog.read(conn, self.table).limits
        rows = self._checked(batch, self._limits)
        if len(rows) >= _COPY_THRESHOLD:
            created = conn.execute("SELECT now()").fetchone()
            assert created is not None
            copy = sql.SQL("COPY {} (" + _COLUMNS + ") FROM STDIN").format(self.table.ident)
            with conn.cursor().copy(copy) as cp:
                for row in rows:
                    cp.write_row((created[0], *row))
        else:
            values = sql.SQL(", ").join(sql.SQL("(now(), %s, %s, %s, %s, %s)") for _ in rows)
            conn.execute(
                sql.SQL("INSERT INTO {} (" + _COLUMNS + ") VALUES ").format(self.table.ident) + values,
                [v for row in rows for v in row],
            )
        return len(rows)

    def stash_sqlalchemy(self, target: SAConnection | Session, records: OutboxRecord | Sequence[OutboxRecord]) -> int:
        """Insert records through a SQLAlchemy ``Connection`` or ``Session`` (its transaction)."""
        from sqlalchemy import text

        batch = [records] if isinstance(records, OutboxRecord) else list(records)
        if not batch:
            return 0
        if self._limits is None:
            found = target.execute(text(catalog.CATALOG_SQL.replace("%s", ":t")), {"t": self.table.quoted}).all()
            self._limits = catalog.columns_from_rows(self.table, [tuple(r) for r in found]).limits
        rows = self._checked(batch, self._limits)
        target.execute(
            text(
                f"INSERT INTO {self.table.quoted} ({_COLUMNS}) VALUES (now(), :topic, :key, :value, :hkeys, :hvalues)"
            ),
            [dict(zip(("topic", "key", "value", "hkeys", "hvalues"), row, strict=True)) for row in rows],
        )
        return len(rows)


def stash(conn: psycopg.Connection[Any], records: OutboxRecord | Sequence[OutboxRecord], table: str = "outbox") -> int:
    """Insert records into ``table`` within ``conn``'s transaction (psycopg)."""
    return Stasher(table).stash(conn, records)

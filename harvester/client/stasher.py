"""Writing outbox records inside the application's own transaction.

The application passes its open connection (psycopg) or connection/session (SQLAlchemy); the
records commit or roll back with the rest of its transaction. Every record is validated against
the table's columns before anything is sent to the database. :class:`BaseStasher` holds what the
synchronous :class:`Stasher` and :class:`~harvester.client.async_stasher.AsyncStasher` share: the
table, the validation, the trace context and the statements; they only run them.
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Iterator, Sequence
from datetime import datetime
from typing import TYPE_CHECKING, Any

import psycopg
from psycopg import sql

from harvester.core.records import ColumnLimits, OutboxRecord
from harvester.postgres.schema import catalog
from harvester.postgres.schema.identifiers import TableName

if TYPE_CHECKING:
    from sqlalchemy import TextClause
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.orm import Session

_COLUMNS = "create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values"
_FIELDS = ("topic", "key", "value", "hkeys", "hvalues")
# Above this many records a COPY beats a multi-row INSERT.
COPY_THRESHOLD = 50

Row = tuple[Any, ...]


@functools.cache
def _trace_headers() -> Callable[[], list[tuple[str, str]]] | None:
    """The OpenTelemetry adapter's header source, or None without the ``otel`` extra (imported on
    first use only, so applications that never stash do not load opentelemetry)."""
    try:
        from harvester.otel import trace_headers
    except ImportError:
        return None
    return trace_headers


class BaseStasher:
    """Writes :class:`OutboxRecord` s into one outbox table; caches the table's column limits.

    With ``trace_context`` (the default) and the ``otel`` extra installed, records stashed while an
    OpenTelemetry span is current carry its W3C ``traceparent`` (and ``tracestate``) headers,
    unless they already carry a ``traceparent``.
    """

    def __init__(
        self, table: str | TableName = "outbox", limits: ColumnLimits | None = None, *, trace_context: bool = True
    ) -> None:
        self.table = table if isinstance(table, TableName) else TableName.parse(table)
        self.trace_context = trace_context
        self._limits = limits

    def _batch(self, records: OutboxRecord | Sequence[OutboxRecord]) -> list[OutboxRecord]:
        """The records as a list, with the current trace context added where it applies."""
        batch = [records] if isinstance(records, OutboxRecord) else list(records)
        source = _trace_headers() if batch and self.trace_context else None
        headers = source() if source is not None else []
        if not headers:
            return batch
        return [r if any(k.lower() == "traceparent" for k in r.header_keys) else r.with_headers(headers) for r in batch]

    def _rows(self, batch: Sequence[OutboxRecord]) -> list[Row]:
        """Validate every record against the table's limits (read before) and return its columns."""
        limits = self._limits
        assert limits is not None
        rows = []
        for r in batch:
            r.check_limits(limits)
            rows.append((r.topic, r.key, r.column_value(limits), list(r.header_keys), list(r.header_values)))
        return rows

    def _insert(self, rows: Sequence[Row]) -> tuple[sql.Composed, list[Any]]:
        """One multi-row INSERT (psycopg) and its parameters."""
        values = sql.SQL(", ").join(sql.SQL("(now(), %s, %s, %s, %s, %s)") for _ in rows)
        statement = sql.SQL("INSERT INTO {} (" + _COLUMNS + ") VALUES ").format(self.table.ident) + values
        return statement, [v for row in rows for v in row]

    def _copy(self) -> sql.Composed:
        """The COPY statement for bulk batches; rows start with the transaction's ``now()``."""
        return sql.SQL("COPY {} (" + _COLUMNS + ") FROM STDIN").format(self.table.ident)

    def _sa_catalog(self) -> tuple[TextClause, dict[str, str]]:
        """The catalog query in SQLAlchemy's form."""
        from sqlalchemy import text

        return text(catalog.CATALOG_SQL.replace("%s", ":t")), {"t": self.table.quoted}

    def _sa_limits(self, found: Sequence[Sequence[Any]]) -> None:
        """Cache the limits from the catalog query's rows."""
        self._limits = catalog.columns_from_rows(self.table, [tuple(r) for r in found]).limits

    def _sa_insert(self, rows: Sequence[Row]) -> tuple[TextClause, list[dict[str, Any]]]:
        """The INSERT in SQLAlchemy's form, with one parameter set per row (executemany)."""
        from sqlalchemy import text

        placeholders = ", ".join(f":{f}" for f in _FIELDS)
        statement = text(f"INSERT INTO {self.table.quoted} ({_COLUMNS}) VALUES (now(), {placeholders})")
        return statement, [dict(zip(_FIELDS, row, strict=True)) for row in rows]


def copy_rows(created: datetime, rows: Sequence[Row]) -> Iterator[Row]:
    """COPY's rows: the ``create_time`` an INSERT would take, then the record's columns."""
    return ((created, *row) for row in rows)


class Stasher(BaseStasher):
    """Stashes records through a synchronous psycopg connection or SQLAlchemy connection/session."""

    def stash(self, conn: psycopg.Connection[Any], records: OutboxRecord | Sequence[OutboxRecord]) -> int:
        """Insert records with a psycopg connection, in its current transaction; return the count.

        Many records go through one COPY, a few through one multi-row INSERT.
        """
        batch = self._batch(records)
        if not batch:
            return 0
        if self._limits is None:
            self._limits = catalog.read(conn, self.table).limits
        rows = self._rows(batch)
        if len(rows) < COPY_THRESHOLD:
            conn.execute(*self._insert(rows))
            return len(rows)
        created = conn.execute("SELECT now()").fetchone()
        assert created is not None
        with conn.cursor().copy(self._copy()) as cp:
            for row in copy_rows(created[0], rows):
                cp.write_row(row)
        return len(rows)

    def stash_sqlalchemy(self, target: SAConnection | Session, records: OutboxRecord | Sequence[OutboxRecord]) -> int:
        """Insert records through a SQLAlchemy ``Connection`` or ``Session`` (its transaction)."""
        batch = self._batch(records)
        if not batch:
            return 0
        if self._limits is None:
            self._sa_limits(target.execute(*self._sa_catalog()).all())
        rows = self._rows(batch)
        target.execute(*self._sa_insert(rows))
        return len(rows)


def stash(conn: psycopg.Connection[Any], records: OutboxRecord | Sequence[OutboxRecord], table: str = "outbox") -> int:
    """Insert records into ``table`` within ``conn``'s transaction (psycopg)."""
    return Stasher(table).stash(conn, records)

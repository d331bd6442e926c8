"""The outbox table in PostgreSQL (psycopg 3): mark, purge, reset, and wake-up on NOTIFY.

Each method uses a connection of its own thread's role (marking, purging, listening), so the
mark loop and the purge/reset pipeline never wait on each other's round trips. A broken
connection is dropped and re-opened on the next call; callers back off and retry, and since
purge and reset are idempotent nothing is lost by retrying.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from harvester.identifiers import TableName
from harvester.migrations import notify_channel
from harvester.record import ColumnLimits, MarkedRecord, ValueKind


class StoreError(Exception):
    """The database could not be reached or refused a statement; retry after a back-off."""


class OutboxMissingError(StoreError):
    """The configured outbox table does not exist."""


_RETURNING = "id, create_time, kafka_topic, kafka_key, {value}, kafka_header_keys, kafka_header_values"


# Key and value column types of a table; one parameter: the table's quoted name (for to_regclass).
DESCRIBE_SQL = """
SELECT a.attname, t.typname, CASE WHEN a.atttypmod > 4 THEN a.atttypmod - 4 END
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = to_regclass(%s) AND a.attname IN ('kafka_key', 'kafka_value') AND NOT a.attisdropped
"""


def limits_from_catalog(table: TableName, rows: Sequence[Sequence[Any]]) -> ColumnLimits:
    """Turn :data:`DESCRIBE_SQL`'s rows into column limits."""
    if not rows:
        raise OutboxMissingError(f"outbox table {table} does not exist (run 'reaper migrate')")
    types = {str(r[0]): (str(r[1]), r[2]) for r in rows}
    key_type, key_len = types.get("kafka_key", ("varchar", None))
    value_type, value_len = types.get("kafka_value", ("varchar", None))
    kind: ValueKind
    if value_type == "bytea":
        kind = "bytes"
    elif value_type in ("json", "jsonb"):
        kind = "json"
    elif value_type in ("varchar", "text", "bpchar"):
        kind = "text"
    else:
        raise StoreError(f"unsupported kafka_value type {value_type!r} in {table}: use varchar, text, jsonb or bytea")
    return ColumnLimits(
        key_max_chars=int(key_len) if key_len is not None and key_type != "text" else None,
        value_max_chars=int(value_len) if value_len is not None and kind == "text" else None,
        value_kind=kind,
    )


def describe(conn: psycopg.Connection[Any], table: TableName) -> ColumnLimits:
    """Read the key and value columns' types from the catalog."""
    return limits_from_catalog(table, conn.execute(DESCRIBE_SQL, (table.quoted,)).fetchall())


class PostgresStore:
    """:class:`harvester.protocols.Store` over one outbox table."""

    def __init__(self, dsn: str, table: TableName, *, application_name: str = "outbox-harvester") -> None:
        self._dsn = dsn
        self._table = table
        self._app = application_name
        self._local = threading.local()
        self._lock = threading.Lock()
        self._connections: list[psycopg.Connection[Any]] = []
        self._limits: ColumnLimits | None = None
        self._listening: psycopg.Connection[Any] | None = None
        self._closed = False

    # ------------------------------------------------------------------ connections

    def _connect(self, autocommit: bool = True) -> psycopg.Connection[Any]:
        try:
            conn = psycopg.connect(
                self._dsn, autocommit=autocommit, connect_timeout=5, application_name=self._app
            )
        except psycopg.Error as exc:
            raise StoreError(f"cannot connect to PostgreSQL: {type(exc).__name__}") from exc
        with self._lock:
            self._connections.append(conn)
        return conn

    def _conn(self) -> psycopg.Connection[Any]:
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                self._forget(conn)
            conn = self._connect()
            self._local.conn = conn
        return conn

    def _forget(self, conn: psycopg.Connection[Any]) -> None:
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        conn.close()

    def _run(self, query: sql.Composed | str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        conn = self._conn()
        try:
            cur = conn.execute(query, params, prepare=True)
            return cur.fetchall() if cur.description else []
        except psycopg.OperationalError as exc:
            self._forget(conn)
            raise StoreError(f"database error: {exc.sqlstate or type(exc).__name__}") from exc
        except psycopg.Error as exc:
            raise StoreError(f"statement failed: {exc.sqlstate or type(exc).__name__}") from exc

    # ------------------------------------------------------------------ statements

    @property
    def limits(self) -> ColumnLimits:
        """The table's column limits (read from the catalog once)."""
        if self._limits is None:
            conn = self._conn()
            try:
                self._limits = describe(conn, self._table)
            except psycopg.OperationalError as exc:
                self._forget(conn)
                raise StoreError(f"database error: {exc.sqlstate or type(exc).__name__}") from exc
            self._build_statements(self._limits)
        return self._limits

    def _build_statements(self, limits: ColumnLimits) -> None:
        value = "kafka_value::text" if limits.value_kind == "json" else "kafka_value"
        t = self._table.ident
        self._mark_sql = sql.SQL(
            "UPDATE {t} SET leader_id = %s WHERE id IN ("
            "SELECT id FROM {t} WHERE leader_id IS NULL OR leader_id <> %s ORDER BY id LIMIT %s) "
            "RETURNING " + _RETURNING.format(value=value)
        ).format(t=t)
        self._purge_sql = sql.SQL("DELETE FROM {} WHERE id = ANY(%s::bigint[])").format(t)
        self._reset_sql = sql.SQL("UPDATE {} SET leader_id = NULL WHERE id = ANY(%s::bigint[])").format(t)
        self._head_sql = sql.SQL(
            "SELECT (SELECT id FROM {t} ORDER BY id LIMIT 1), (SELECT id FROM {t} ORDER BY id DESC LIMIT 1), "
            "(SELECT create_time FROM {t} ORDER BY id LIMIT 1)"
        ).format(t=t)

    def mark(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Mark up to ``limit`` records not yet marked by ``leader_id`` and return them sorted by id."""
        kind = self.limits.value_kind
        rows = self._run(self._mark_sql, (leader_id, leader_id, limit))
        rows.sort(key=lambda r: r[0])  # RETURNING order is arbitrary
        out: list[MarkedRecord] = []
        for rid, created, topic, key, value, hkeys, hvalues in rows:
            if value is not None and kind != "bytes":
                value = value.encode("utf-8")
            headers = [(k, v.encode("utf-8") if v is not None else b"") for k, v in zip(hkeys, hvalues, strict=False)]
            out.append(MarkedRecord(rid, created, topic, key, value, headers))
        return out

    def purge(self, ids: Sequence[int]) -> None:
        """Delete delivered records in one statement."""
        if ids:
            self._run(self._purge_sql, (list(ids),))

    def reset(self, ids: Sequence[int]) -> None:
        """Unmark records whose delivery failed, in one statement."""
        if ids:
            self._run(self._reset_sql, (list(ids),))

    def head(self) -> tuple[int, float | None]:
        """A cheap backlog sample: (max id - min id + 1, age in seconds of the oldest record)."""
        self.limits  # noqa: B018 - builds the statements
        rows = self._run(self._head_sql, ())
        lo, hi, oldest = rows[0]
        if lo is None:
            return 0, None
        age_rows = self._run("SELECT extract(epoch FROM now() - %s::timestamptz)::float8", (oldest,))
        return int(hi) - int(lo) + 1, float(age_rows[0][0])

    # ------------------------------------------------------------------ idle wake-up

    def wait_for_insert(self, timeout: float) -> bool:
        """Block until the outbox trigger notifies (True) or ``timeout`` passes (False).

        Without the trigger (migration not applied) this simply sleeps; the caller's adaptive
        back-off keeps the polling rate low either way.
        """
        try:
            if self._listening is None or self._listening.closed or self._listening.broken:
                conn = self._connect()
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(self._table))))
                self._listening = conn
            for _ in self._listening.notifies(timeout=timeout, stop_after=1):
                return True
            return False
        except psycopg.Error as exc:
            if self._listening is not None:
                self._forget(self._listening)
                self._listening = None
            raise StoreError(f"listen failed: {type(exc).__name__}") from exc

    def close(self) -> None:
        """Close every connection this store opened."""
        self._closed = True
        with self._lock:
            conns, self._connections = self._connections, []
        for conn in conns:
            conn.close()

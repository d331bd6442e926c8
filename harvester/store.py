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
from harvester.identity import IdentityHeaders
from harvester.migrations import available, dead_letter_table, fence_table, notify_channel, render
from harvester.protocols import FencedError, StoreError
from harvester.record import ColumnLimits, Failure, MarkedRecord, ValueKind

__all__ = ["FencedError", "OutboxMissingError", "PostgresStore", "StoreError"]


class OutboxMissingError(StoreError):
    """The configured outbox table does not exist."""


_RETURNING = "id, create_time, kafka_topic, kafka_key, {value}, kafka_header_keys, kafka_header_values, {attempts}"
_ATTEMPT_COLUMNS = "harvest_attempts, harvest_first_failure"
_NO_ATTEMPT_COLUMNS = "0, NULL::timestamptz"


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


def _malformed(key: str | None, hkeys: list[str] | None, hvalues: list[str | None] | None) -> str | None:
    """Why a row cannot become a Kafka message, or None when it can."""
    if key is None:
        return "kafka_key is NULL"
    if hkeys is None or hvalues is None:
        return "header arrays are NULL"
    if len(hkeys) != len(hvalues):
        return f"{len(hkeys)} header keys but {len(hvalues)} header values"
    if any(k is None for k in hkeys):
        return "a header key is NULL"
    return None


class PostgresStore:
    """:class:`harvester.protocols.Store` over one outbox table."""

    def __init__(
        self,
        dsn: str,
        table: TableName,
        *,
        application_name: str = "outbox-harvester",
        identity: IdentityHeaders | None = None,
        producer_name: str | None = None,
        hold_dead_letter_keys: bool = False,
    ) -> None:
        self._dsn = dsn
        self._table = table
        self._fence = fence_table(table)
        self._names = identity or IdentityHeaders()
        self._producer = producer_name
        self._epoch = 0
        self._tracks_attempts = False
        self._dead_letter_ready = False
        self._hold = hold_dead_letter_keys
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
            conn = psycopg.connect(self._dsn, autocommit=autocommit, connect_timeout=5, application_name=self._app)
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

    def _execute(self, query: sql.Composed | str, params: Sequence[Any]) -> psycopg.Cursor[Any]:
        conn = self._conn()
        try:
            return conn.execute(query, params, prepare=True)
        except psycopg.OperationalError as exc:
            self._forget(conn)
            raise StoreError(f"database error: {exc.sqlstate or type(exc).__name__}") from exc
        except psycopg.Error as exc:
            raise StoreError(f"statement failed: {exc.sqlstate or type(exc).__name__}") from exc

    def _run(self, query: sql.Composed | str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        cur = self._execute(query, params)
        return cur.fetchall() if cur.description else []

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

    def prepare(self) -> ColumnLimits:
        """Read the table's columns from the catalog and build the statements (once); raises
        :class:`OutboxMissingError` or :class:`StoreError` on a missing or unsupported table."""
        return self.limits

    def _build_statements(self, limits: ColumnLimits) -> None:
        value = "kafka_value::text" if limits.value_kind == "json" else "kafka_value"
        found = self._run(
            "SELECT count(*) FROM pg_attribute WHERE attrelid = to_regclass(%s)"
            " AND attname IN ('harvest_attempts', 'harvest_first_failure', 'harvest_last_error') AND NOT attisdropped",
            (self._table.quoted,),
        )
        self._tracks_attempts = int(found[0][0]) == 3
        attempts = _ATTEMPT_COLUMNS if self._tracks_attempts else _NO_ATTEMPT_COLUMNS
        held: sql.Composable = sql.SQL("")
        if self._hold:
            self._ensure_dead_letter()
            held = sql.SQL(" AND NOT EXISTS (SELECT 1 FROM {d} WHERE {d}.kafka_key = {t}.kafka_key)").format(
                d=dead_letter_table(self._table).ident, t=self._table.ident
            )
        # Every change runs in one statement that first share-locks the fence row at this
        # process's epoch: after a newer epoch commits, the CTE is empty and nothing changes.
        guard = "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND epoch = %s FOR SHARE) "
        t, f = self._table.ident, self._fence.ident
        self._mark_sql = sql.SQL(
            guard + "UPDATE {t} SET leader_id = %s WHERE EXISTS (SELECT 1 FROM fence) AND id IN ("
            "SELECT id FROM {t} WHERE (leader_id IS NULL OR leader_id <> %s){held} ORDER BY id LIMIT %s) "
            "RETURNING " + _RETURNING.format(value=value, attempts=attempts)
        ).format(t=t, f=f, held=held)
        self._purge_sql = sql.SQL(
            guard + "DELETE FROM {t} WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(%s::bigint[])"
        ).format(t=t, f=f)
        self._reset_sql = sql.SQL(
            guard + "UPDATE {t} SET leader_id = NULL WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(%s::bigint[])"
        ).format(t=t, f=f)
        if self._tracks_attempts:
            self._fail_sql = sql.SQL(
                guard + "UPDATE {t} SET leader_id = NULL, harvest_attempts = harvest_attempts + 1,"
                " harvest_first_failure = coalesce(harvest_first_failure, now()), harvest_last_error = u.err"
                " FROM unnest(%s::bigint[], %s::text[]) AS u(id, err)"
                " WHERE EXISTS (SELECT 1 FROM fence) AND {t}.id = u.id"
            ).format(t=t, f=f)
        self._dead_letter_sql = sql.SQL(
            guard + "{moved} INSERT INTO {d} (id, create_time, kafka_topic, kafka_key, kafka_value,"
            " kafka_header_keys, kafka_header_values, reason, error, attempts, first_failure, last_failure,"
            " epoch, leader_id)"
            " SELECT m.id, m.create_time, m.kafka_topic, m.kafka_key, m.kafka_value, m.kafka_header_keys,"
            " m.kafka_header_values, u.reason, u.err, u.attempts, coalesce(u.first, now()), now(), %s, %s"
            " FROM moved m JOIN unnest(%s::bigint[], %s::text[], %s::text[], %s::int[], %s::timestamptz[])"
            " AS u(id, reason, err, attempts, first) ON u.id = m.id ON CONFLICT (id) DO NOTHING"
        ).format(
            moved=sql.SQL(
                ", moved AS (DELETE FROM {t} WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(%s::bigint[]) RETURNING *)"
            ).format(t=t),
            d=dead_letter_table(self._table).ident,
            f=f,
        )
        self._epoch_sql = sql.SQL("SELECT epoch FROM {} WHERE outbox_table = %s").format(f)
        self._head_sql = sql.SQL(
            "SELECT (SELECT id FROM {t} ORDER BY id LIMIT 1), (SELECT id FROM {t} ORDER BY id DESC LIMIT 1), "
            "(SELECT create_time FROM {t} ORDER BY id LIMIT 1)"
        ).format(t=t)

    # ------------------------------------------------------------------ fencing

    @property
    def epoch(self) -> int:
        """The epoch this store's statements run under (0 before :meth:`acquire`)."""
        return self._epoch

    def acquire(self, leader_id: UUID) -> int:
        """Bump the fence epoch (creating the fence table if absent) and run under the new epoch."""
        self.prepare()
        f = self._fence.ident
        self._run(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {f} (outbox_table TEXT PRIMARY KEY, epoch BIGINT NOT NULL,"
                " leader_id UUID, acquired_at TIMESTAMPTZ NOT NULL DEFAULT now(),"
                " checkpoint_position BIGINT NOT NULL DEFAULT 0)"
            ).format(f=f),
            (),
        )
        self._run(
            sql.SQL("ALTER TABLE {} ADD COLUMN IF NOT EXISTS checkpoint_position BIGINT NOT NULL DEFAULT 0").format(f),
            (),
        )
        rows = self._run(
            sql.SQL(
                "INSERT INTO {f} AS x (outbox_table, epoch, leader_id) VALUES (%s, 1, %s) "
                "ON CONFLICT (outbox_table) DO UPDATE SET epoch = x.epoch + 1, leader_id = excluded.leader_id,"
                " acquired_at = now() RETURNING epoch"
            ).format(f=f),
            (self._table.qualified, leader_id),
        )
        self._epoch = int(rows[0][0])
        return self._epoch

    def _ensure_dead_letter(self) -> None:
        """Create the dead-letter table and its key index if ``reaper migrate`` has not."""
        if self._dead_letter_ready:
            return
        conn = self._conn()
        for migration in available():
            if "_dead_letter" in migration.version:
                self._run(render(migration, self._table, conn), ())
        self._dead_letter_ready = True

    def checkpoint_position(self) -> int:
        """Where exactly-once recovery starts reading the checkpoint topic."""
        rows = self._run(
            sql.SQL("SELECT checkpoint_position FROM {} WHERE outbox_table = %s").format(self._fence.ident),
            (self._table.qualified,),
        )
        return int(rows[0][0]) if rows else 0

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Purge records of committed transactions and advance the checkpoint position, atomically,
        under the fence (the row lock also orders this against a newer leader's bump)."""
        t, f = self._table.ident, self._fence.ident
        cur = self._execute(
            sql.SQL(
                "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND epoch = %s FOR UPDATE),"
                " gone AS (DELETE FROM {t} WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(%s::bigint[]))"
                " UPDATE {f} SET checkpoint_position = greatest(checkpoint_position, %s)"
                " WHERE outbox_table = %s AND EXISTS (SELECT 1 FROM fence)"
            ).format(t=t, f=f),
            (self._table.qualified, self._epoch, list(ids), position, self._table.qualified),
        )
        if cur.rowcount == 0:
            raise FencedError(f"fenced: epoch {self._epoch} superseded")

    def _check_epoch(self) -> None:
        """Raise :class:`FencedError` if a newer epoch superseded ours (called on short results only)."""
        rows = self._run(self._epoch_sql, (self._table.qualified,))
        current = int(rows[0][0]) if rows else 0
        if current != self._epoch:
            raise FencedError(f"fenced: epoch {self._epoch} superseded by {current}")

    @property
    def producer_name(self) -> str:
        """The stable producer name of the identity headers."""
        if self._producer is None:
            rows = self._run("SELECT system_identifier FROM pg_control_system()", ())
            self._producer = f"{rows[0][0]}/{self._table.qualified}"
        return self._producer

    # ------------------------------------------------------------------ statements

    def mark(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Mark up to ``limit`` records not yet marked by ``leader_id`` and return them sorted by id.

        Each record's headers get the identity headers appended.
        """
        kind = self.limits.value_kind
        producer = self.producer_name.encode("utf-8")
        epoch = str(self._epoch).encode()
        names = self._names
        rows = self._run(self._mark_sql, (self._table.qualified, self._epoch, leader_id, leader_id, limit))
        if not rows:
            self._check_epoch()
            return []
        rows.sort(key=lambda r: r[0])  # RETURNING order is arbitrary
        out: list[MarkedRecord] = []
        for rid, created, topic, key, raw, hkeys, hvalues, attempts, first_failure in rows:
            value = raw.encode("utf-8") if raw is not None and kind != "bytes" else raw
            malformed = _malformed(key, hkeys, hvalues)
            headers: list[tuple[str, str | bytes | None]] = [
                (k, v.encode("utf-8") if v is not None else b"")
                for k, v in zip(hkeys or (), hvalues or (), strict=False)
            ]
            headers += [(names.id, str(rid).encode()), (names.epoch, epoch), (names.producer, producer)]
            out.append(MarkedRecord(rid, created, topic, key or "", value, headers, attempts, first_failure, malformed))
        return out

    @property
    def tracks_attempts(self) -> bool:
        """Whether the table has the optional attempt columns (``reaper migrate`` adds them)."""
        self.prepare()
        return self._tracks_attempts

    def fail(self, failures: Sequence[Failure]) -> None:
        """Unmark permanently failed records, counting the attempt and keeping the error."""
        if not failures:
            return
        if not self._tracks_attempts:
            self.reset([f.id for f in failures])
            return
        cur = self._execute(
            self._fail_sql, (self._table.qualified, self._epoch, [f.id for f in failures], [f.error for f in failures])
        )
        if cur.rowcount < len(failures):
            self._check_epoch()

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        """Move records into the dead-letter table (created on demand) in one statement."""
        if not failures:
            return
        self._ensure_dead_letter()
        ids = [f.id for f in failures]
        cur = self._execute(
            self._dead_letter_sql,
            (
                self._table.qualified,
                self._epoch,
                ids,
                self._epoch,
                leader_id,
                ids,
                [f.reason for f in failures],
                [f.error for f in failures],
                [f.attempts for f in failures],
                [f.first_failure for f in failures],
            ),
        )
        if cur.rowcount < len(failures):
            self._check_epoch()

    def purge(self, ids: Sequence[int]) -> None:
        """Delete delivered records in one statement (idempotent)."""
        self._fenced_change(self._purge_sql, ids)

    def reset(self, ids: Sequence[int]) -> None:
        """Unmark records whose delivery failed, in one statement (idempotent)."""
        self._fenced_change(self._reset_sql, ids)

    def _fenced_change(self, statement: sql.Composed, ids: Sequence[int]) -> None:
        if not ids:
            return
        cur = self._execute(statement, (self._table.qualified, self._epoch, list(ids)))
        if cur.rowcount < len(ids):  # fenced, or a retry of a change that already committed
            self._check_epoch()

    def head(self) -> tuple[int, float | None]:
        """A cheap backlog sample: (max id - min id + 1, age in seconds of the oldest record)."""
        self.prepare()
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

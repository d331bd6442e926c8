"""The connections of a store (:class:`Connections`): one per thread that uses
the store (marking, purging, listening), so the mark loop and the purge/reset pipeline never wait
on each other's round trips. A broken connection is dropped and re-opened on the next call; a
failure becomes a :class:`StoreError` with libpq's or the server's reason, never a value or a DSN.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import conninfo_to_dict

from harvester.core.protocols import StoreError, StoreUnreachableError
from harvester.postgres.deadline import Deadlines, limit_statements, tcp_settings


def dsn_options(dsn: str) -> str:
    """The DSN's own ``options`` (empty if none, or if the DSN is malformed: connecting reports that)."""
    try:
        return str(conninfo_to_dict(dsn).get("options") or "")
    except psycopg.Error:
        return ""


class Connections:
    """A connection per thread, each opened on first use and re-opened once broken, every statement
    under the client-side deadline of ``statement_timeout`` (0: none). ``options`` are the server
    options of every session, after the DSN's own."""

    def __init__(self, dsn: str, *, application_name: str, options: str = "", statement_timeout: float = 0.0) -> None:
        own = dsn_options(dsn)
        self.dsn = dsn
        self.application_name = application_name
        self.options = " ".join(filter(None, [own, options]))
        # A stalled path (no answer, no reset) is noticed within statement_timeout: the server
        # cancels a statement that runs longer, TCP gives up on unacknowledged data and on a silent
        # peer (keepalives), and the client-side deadline ends a statement the path holds up.
        self._deadlines = Deadlines(statement_timeout)
        self._tcp = tcp_settings(dsn, statement_timeout)
        # The server's limit in seconds, unless off or the DSN's options set one of their own (0: left alone).
        self.server_limit = statement_timeout if statement_timeout > 0 and "statement_timeout" not in own else 0
        self._local = threading.local()
        self._lock = threading.Lock()  # guards _connections
        self._connections: list[psycopg.Connection[Any]] = []
        # Called, from the failing thread, when a connection broke (not a statement cancelled) or
        # could not be opened.
        self.on_broken: Callable[[], None] = lambda: None

    @property
    def statement_timeout(self) -> float:
        """The client-side deadline of a statement in seconds (0: none)."""
        return self._deadlines.seconds

    def connect(self) -> psycopg.Connection[Any]:
        """A new connection, closed by :meth:`close` (or :meth:`forget`)."""
        started = time.monotonic()
        try:
            conn = psycopg.connect(
                self.dsn,
                autocommit=True,
                connect_timeout=5,
                application_name=self.application_name,
                options=self.options,
                **self._tcp,
            )
            if self.server_limit:
                limit_statements(conn, self.server_limit)
        except psycopg.Error as exc:
            # libpq's reason (wrong password, port or database, ...), first line only: later lines
            # repeat it for other addresses or add hints. libpq may quote a malformed DSN's text;
            # the reaper redacts secrets from everything it prints.
            self.on_broken()
            lines = str(exc).strip().splitlines()
            reason = with_hint(" ".join(lines[0].split()) if lines else type(exc).__name__)
            raise StoreUnreachableError(f"cannot connect to PostgreSQL: {reason}", since=started) from exc
        with self._lock:
            self._connections.append(conn)
        return conn

    def conn(self) -> psycopg.Connection[Any]:
        """The calling thread's connection."""
        conn: psycopg.Connection[Any] | None = getattr(self._local, "conn", None)
        if conn is None or conn.closed or conn.broken:
            if conn is not None:
                self.forget(conn)
            conn = self.connect()
            self._local.conn = conn
        return conn

    def pids(self) -> list[int]:
        """The server processes of the connections open now."""
        with self._lock:
            return [c.info.backend_pid for c in self._connections if not c.closed]

    def forget(self, conn: psycopg.Connection[Any]) -> None:
        """Close ``conn``, one of these connections."""
        with self._lock:
            if conn in self._connections:
                self._connections.remove(conn)
        conn.close()

    def execute(self, query: sql.Composed | sql.SQL | str, params: Sequence[Any]) -> psycopg.Cursor[Any]:
        """Run ``query`` (prepared) on the calling thread's connection, under the deadline."""
        conn = self.conn()
        with self.guarded(conn):
            return conn.execute(query, params, prepare=True)

    @contextmanager
    def guarded(self, conn: psycopg.Connection[Any]) -> Iterator[None]:
        """Run statements on ``conn`` under the deadline; a failure becomes a :class:`StoreError`,
        one of the path dated from when the statements were sent."""
        started = time.monotonic()
        try:
            with self._deadlines.guard(conn) as expired:
                yield
        except psycopg.Error as exc:
            # Out of the guard: the watchdog no longer touches the connection that is closed here.
            if expired.fired:
                self.forget(conn)
                raise StoreUnreachableError(
                    f"no answer within statementTimeout ({self._deadlines.seconds:g} s): connection dropped",
                    since=started,
                ) from exc
            raise self.failed(conn, exc, started) from exc

    def failed(self, conn: psycopg.Connection[Any], exc: psycopg.Error, started: float) -> StoreError:
        """The StoreError for ``exc``, raised by a statement on ``conn`` sent at ``started``."""
        if isinstance(exc, psycopg.OperationalError):
            broken = conn.broken
            self.forget(conn)
            if broken:
                self.on_broken()
            return StoreUnreachableError(f"database error: {error_text(exc)}", since=started)
        return StoreError(f"statement failed: {error_text(exc)}")

    def run(self, query: sql.Composed | sql.SQL | str, params: Sequence[Any]) -> list[tuple[Any, ...]]:
        """:meth:`execute`, then the rows it returned (none for a statement that returns none)."""
        cur = self.execute(query, params)
        return cur.fetchall() if cur.description else []

    def close(self) -> None:
        """Stop the deadline's watchdog and close every connection opened so far."""
        self._deadlines.close()
        with self._lock:
            conns, self._connections = self._connections, []
        for conn in conns:
            conn.close()


def with_hint(reason: str) -> str:
    """libpq's refusal of a connection, with the connection setting that fixes a TLS or password one."""
    hint = next((h for cause, h in _HINTS if cause in reason), None)
    return f"{reason} ({hint})" if hint else reason


_HINTS = (
    ("certificate verify failed", "sslrootcert: the CA that signed the server's certificate"),
    ("does not match host name", "host: a name in the server's certificate (hostaddr may give its address)"),
    ("password authentication failed", "the password: in the data source, PGPASSWORD or PGPASSFILE"),
    ("no pg_hba.conf entry", "sslmode: the server takes only TLS connections (hostssl), or this role is not allowed"),
    ("root certificate file", "sslrootcert: a CA file readable here (HOME=/nonexistent in the image: set it)"),
)


def error_text(exc: psycopg.Error) -> str:
    """SQLSTATE and the server's message (``22001 value too long for type character varying(10000)``),
    or the client's first line when the server said nothing (a lost connection). Values and DSNs are
    left out: the server's primary message names types and objects, not data."""
    primary = exc.diag.message_primary if exc.sqlstate else None
    lines = str(exc).strip().splitlines()
    text = primary or (" ".join(lines[0].split()) if lines else "")
    if exc.sqlstate == "42501":  # insufficient_privilege
        text += ": a grant the role lacks ('reaper check' names it, 'reaper grants' prints them all)"
    return " ".join(filter(None, [exc.sqlstate or type(exc).__name__, text]))

"""A client-side deadline for the harvester's statements: a stalled database path is noticed.

A path that stops forwarding without resetting (a partition, a hung proxy or load balancer) leaves
a statement waiting for an answer that never comes, and neither the server's ``statement_timeout``
(the statement may never have reached it) nor TCP (a middlebox that keeps acknowledging) ends it.
:class:`Deadlines` watches the statements running on a store's connections and shuts down the
socket of one that outlives ``statementTimeout``; libpq then reports the connection lost, the store
drops it and raises :class:`harvester.core.protocols.StoreUnreachableError`, and the next call
connects afresh.
"""

from __future__ import annotations

import os
import socket
import threading
import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any

import psycopg
from psycopg.conninfo import conninfo_to_dict


class Expired:
    """Set when the watchdog ended the statement it was handed out for."""

    __slots__ = ("fired",)

    def __init__(self) -> None:
        self.fired = False


class Deadlines:
    """One watchdog thread per store (started on first use); ``seconds`` <= 0 turns it off."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds
        self._lock = threading.Lock()
        self._running: dict[Expired, tuple[psycopg.Connection[Any], float]] = {}
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @contextmanager
    def guard(self, conn: psycopg.Connection[Any]) -> Iterator[Expired]:
        """Run a statement on ``conn`` under the deadline; the yielded flag says whether it fired."""
        expired = Expired()
        if self.seconds <= 0:
            yield expired
            return
        with self._lock:
            self._running[expired] = (conn, time.monotonic() + self.seconds)
            if self._thread is None:
                self._thread = threading.Thread(target=self._watch, name="harvester-deadline", daemon=True)
                self._thread.start()
        try:
            yield expired
        finally:
            with self._lock:
                self._running.pop(expired, None)

    def close(self) -> None:
        self._closed.set()

    def _watch(self) -> None:
        while not self._closed.wait(min(1.0, self.seconds / 4)):
            now = time.monotonic()
            with self._lock:  # the statement's thread cannot finish (and reuse the connection) meanwhile
                for expired, (conn, deadline) in list(self._running.items()):
                    if now >= deadline:
                        del self._running[expired]
                        expired.fired = True
                        _shut_down(conn)


def _shut_down(conn: psycopg.Connection[Any]) -> None:
    """End the connection's TCP stream under libpq: its pending read returns at once. The socket is
    shut down through a duplicate descriptor, so libpq's own stays valid until the store closes it."""
    with suppress(OSError, psycopg.Error):
        duplicate = socket.socket(fileno=os.dup(conn.pgconn.socket))
        with duplicate:
            duplicate.shutdown(socket.SHUT_RDWR)


def limit_statements(conn: psycopg.Connection[Any], seconds: float) -> None:
    """The server's statement_timeout for this session (0: none)."""
    conn.execute("SELECT set_config('statement_timeout', %s, false)", (f"{round(seconds * 1000)}ms",))


def tcp_settings(dsn: str, seconds: float) -> dict[str, Any]:
    """libpq's TCP settings that notice a dead path within about ``seconds``: data unacknowledged
    that long, or a silent peer after keepalives. Those the DSN sets itself are left as it says."""
    if seconds <= 0:
        return {}
    whole = max(1, round(seconds))
    wanted = {
        "keepalives": 1,
        "keepalives_idle": max(1, whole // 2),
        "keepalives_interval": max(1, whole // 6),
        "keepalives_count": 3,
        "tcp_user_timeout": whole * 1000,
    }
    given = conninfo_to_dict(dsn)
    return {name: value for name, value in wanted.items() if name not in given}

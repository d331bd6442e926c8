"""Vacuuming the outbox while a large backlog drains.

Every purged record leaves a dead row version and a dead index entry at the head of the id order,
exactly where the next mark starts its index scan; every mark leaves another (a mark is rarely a
HOT update on pages that COPY packed full). Autovacuum wakes at most once a minute and then only
past a share of the table, so during a drain of a million records the mark query walks ever more
dead entries: the drain slowed by a fifth at a 1,000,000 backlog against 100,000. A ``VACUUM``
every so many purged records keeps the head clean (``./dev.sh bench harvest`` compares the drain at
both backlogs).

It runs on a thread and a connection of its own, never on the hot path; ``SKIP_LOCKED`` leaves
the table to an autovacuum already at work. Only the table's owner (or a superuser) may vacuum it:
for anyone else this is switched off once, with a log line, and autovacuum does the work.
"""

from __future__ import annotations

import threading
import time
from typing import Any

import psycopg
import structlog
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName

log = structlog.get_logger("harvester.vacuum")

_MIN_INTERVAL = 2.0  # seconds between two vacuums, however fast records are purged

_MAY_VACUUM = """
SELECT pg_has_role(c.relowner, 'MEMBER') OR (SELECT rolsuper FROM pg_roles WHERE rolname = current_user)
FROM pg_class c WHERE c.oid = to_regclass(%s)
"""


class Vacuumer:
    """Vacuums ``table`` after every ``every`` purged records (0: never)."""

    def __init__(self, dsn: str, table: TableName, every: int, connect_options: dict[str, Any]) -> None:
        self._dsn = dsn
        self._table = table
        self._every = every
        self._options = connect_options
        self._lock = threading.Lock()
        self._purged = 0  # since the last vacuum; guarded by _lock
        self._due = threading.Event()
        self._closed = threading.Event()
        self._thread: threading.Thread | None = None

    @property
    def every(self) -> int:
        """Purged records between two vacuums (0: never)."""
        return self._every

    def purged(self, records: int) -> None:
        """``records`` left the outbox; start a vacuum when enough have."""
        if self._every <= 0 or records <= 0:
            return
        with self._lock:
            self._purged += records
            if self._purged < self._every or self._closed.is_set():
                return
            self._purged = 0
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="harvester-vacuum", daemon=True)
                self._thread.start()
        self._due.set()

    def close(self) -> None:
        """Stop the thread (a vacuum in progress finishes on the server)."""
        self._closed.set()
        self._due.set()

    def _loop(self) -> None:
        conn: psycopg.Connection[Any] | None = None
        try:
            while self._due.wait() and not self._closed.is_set():
                self._due.clear()
                started = time.monotonic()
                try:
                    if conn is None or conn.closed or conn.broken:
                        conn = psycopg.connect(self._dsn, autocommit=True, **self._options)
                        if not self._allowed(conn):
                            return
                    conn.execute(sql.SQL("VACUUM (SKIP_LOCKED) {}").format(self._table.ident))
                    log.debug("outbox_vacuumed", seconds=round(time.monotonic() - started, 3))
                except psycopg.Error as exc:  # the next purge past the threshold tries again
                    log.warning("vacuum_failed", error=exc.sqlstate or type(exc).__name__)
                self._closed.wait(max(0.0, _MIN_INTERVAL - (time.monotonic() - started)))
        finally:
            if conn is not None:
                conn.close()

    def _allowed(self, conn: psycopg.Connection[Any]) -> bool:
        row = conn.execute(_MAY_VACUUM, (self._table.quoted,)).fetchone()
        if row is not None and row[0]:
            return True
        log.info("vacuum_off", reason="only the outbox's owner may vacuum it; autovacuum cleans up instead")
        self._every = 0
        return False

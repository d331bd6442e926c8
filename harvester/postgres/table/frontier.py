"""How far behind it a mark may stop looking, without missing a transaction that commits late.

A mark reads the outbox's first rows by id that are not handed out yet. Behind the rows it hands
out, the primary key holds the rows still in flight (handed out, not yet purged: thousands in a
burst's drain), which every mark walked past again, visiting each row. Ids below a *frontier* need
no look: every row there that will ever be visible is handed out already.

Where the frontier may stand follows from how ids are taken. An id comes from the table's sequence
(cache 1, so in the order its takers called it) while an INSERT or COPY into the table runs, which
holds a lock on the table from before it takes the id until its transaction ends. So:

1. A mark sees a row with id ``C``: every id up to ``C`` was taken before the mark's snapshot.
2. Right after the mark (a full one: a backlog's, where the walk it saves is), the store reads the
   transactions that hold a writer's lock on the table (``pg_locks``, readable by every role). Each
   taker of an id up to ``C`` has then either ended, committed for any later snapshot or never, or
   is among them.
3. Once a later read finds none of them left, or the first read found none, every row up to ``C``
   that will ever be visible is visible to the snapshot of any statement after that read: ``C`` is
   *settled*. The next mark, which still looks from the old frontier, finds any of them that committed
   late, so after it the frontier moves to ``C`` (to the mark's last id if it stopped short of ``C``).

A reset makes ids eligible again: the frontier falls back below them
(:class:`~harvester.postgres.table.marks.HandedOut`). The store's own connections only purge, so
their locks do not count. Holding dead-lettered keys, the mark passes over rows it does not hand
out: no frontier then. Neither with a sequence that caches ids, or without one owned by the id
column: ids are then not taken in order.

The frontier trusts that an id is taken by the statement that inserts it. An application that takes
ids with ``nextval()`` ahead of its INSERT, or writes ids of its own, keeps its rows harvested by a
sweep: every ``SWEEP_SECONDS`` a mark looks from the start again. A key's order against such rows is
what the sweep's timing makes it.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.table.marks import FIRST_ID, Exclusion, HandedOut

SWEEP_SECONDS = 10.0
_WAITING = 32  # reads of the writers waited on at once

# The locks a transaction that writes the table holds on it (an INSERT's RowExclusiveLock, or a
# stronger one taken beside it); prepared transactions hold theirs without a pid.
WRITERS = sql.SQL(
    "SELECT coalesce(array_agg(virtualtransaction), '{}') FROM pg_locks WHERE locktype = 'relation'"
    " AND database = (SELECT oid FROM pg_database WHERE datname = current_database())"
    " AND relation = %s::regclass"
    " AND mode IN ('RowExclusiveLock', 'ShareRowExclusiveLock', 'ExclusiveLock', 'AccessExclusiveLock')"
    " AND (pid IS NULL OR pid <> ALL(%s::int[]))"
)


def ordered_ids(conn: psycopg.Connection[Any], table: TableName) -> bool:
    """Whether ``table``'s ids come from a sequence of its own that hands them out in order."""
    row = conn.execute(
        "SELECT s.seqcache FROM pg_attribute a JOIN pg_depend d ON d.refclassid = 'pg_class'::regclass"
        " AND d.refobjid = a.attrelid AND d.refobjsubid = a.attnum AND d.classid = 'pg_class'::regclass"
        " AND d.deptype IN ('a', 'i') JOIN pg_sequence s ON s.seqrelid = d.objid"
        " WHERE a.attrelid = to_regclass(%s) AND a.attname = 'id'",
        (table.quoted,),
    ).fetchone()
    return row is not None and int(row[0]) == 1


class Settling:
    """Which ids are settled, from the reads of the table's writers that follow the marks (the mark
    thread's alone)."""

    def __init__(self) -> None:
        self.settled = FIRST_ID  # every id up to it is settled for a statement sent from now on
        self._seen = FIRST_ID  # the highest id a mark saw
        # (the ids a mark saw up to, who might still commit one of them), a read after that mark
        # finding them; ascending. Writers overlap from read to read under a steady load, so each
        # read's waits apart, and one whose writers are all gone settles every id it covers.
        self._waiting: list[tuple[int, frozenset[str]]] = []

    def seen(self, highest: int, writers: Sequence[str]) -> None:
        """A mark saw ids up to ``highest`` (:data:`FIRST_ID`: none), and a read after it found ``writers``."""
        now = frozenset(writers)
        self._seen = max(self._seen, highest)
        if not now:
            self.settled, self._waiting = self._seen, []
            return
        gone = [upto for upto, waited in self._waiting if not waited & now]
        if gone:
            self.settled = max(self.settled, *gone)
            self._waiting = [(upto, waited) for upto, waited in self._waiting if upto > self.settled]
        if len(self._waiting) == _WAITING:
            self._waiting.pop()  # the newer read covers what it covered, and later
        self._waiting.append((self._seen, now))


class Frontier:
    """The frontier's upkeep around each mark of one store (the mark thread's alone): what the mark
    skips, and after it, how far the frontier moves and whether the table's writers are read."""

    def __init__(self, handed: HandedOut) -> None:
        self._handed = handed
        self._settling = Settling()
        self._settled = FIRST_ID  # what was settled when the mark under way was sent
        self._sweep_at = 0.0

    def before(self, leader_id: UUID, *, enabled: bool) -> Exclusion:
        """What the next mark skips: from the frontier, or every id handed out when the frontier is
        off or a sweep is due."""
        self._settled, now = self._settling.settled, time.monotonic()
        sweep = now >= self._sweep_at
        if sweep:
            self._sweep_at = now + SWEEP_SECONDS
        return self._handed.exclude(leader_id, sweep=sweep or not enabled)

    def after(
        self, leader_id: UUID, skip: Exclusion, ids: Sequence[int], limit: int, writers: Callable[[], Sequence[str]]
    ) -> None:
        """The mark that skipped ``skip`` handed out ``ids`` (ascending) of at most ``limit``: a
        full mark handed out everything unhanded up to its last id, an empty or short one everything
        its snapshot saw. ``writers`` reads the table's writers, a round trip of its own: worth it
        after full marks only (a backlog, whose records in flight the next marks would walk past),
        not at a trickle."""
        highest = ids[-1] if ids else FIRST_ID
        if self._settled > FIRST_ID:
            upto = min(self._settled, highest) if len(ids) >= limit else self._settled
            self._handed.advance(leader_id, skip, upto + 1)
        if len(ids) >= limit:
            self._settling.seen(highest, writers())

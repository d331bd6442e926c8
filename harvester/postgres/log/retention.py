"""The log source over a table with a retention window: delivered rows stay in the table for a
while and are deleted later, in bulk, instead of one DELETE per completion batch (the log source's
largest PostgreSQL cost in a burst). Records complete as in
:mod:`harvester.postgres.log.position`: the position done is stored in the fence row, and
:class:`RetentionWindow` is the part of that :class:`~.position.StoredPosition` which sweeps.

Which rows are delivered: the WAL carries every insert whatever happens to the row later, so the
slot, not the table, is what delivery rests on; rows are kept only for the operators (and for the
switch back to mark-purge/reset, which publishes whatever the table holds). The statement that
stores the position also keeps a *cut*: the oldest transaction id still running then
(``txid_snapshot_xmin``) and the end of the log just after. Every transaction older than that id
had committed (or aborted) by then, subtransactions included (a subtransaction's id is above its
parent's), so its commit record lies before that end of the log. Once the stored position reaches
it, every row inserted by a transaction older than the cut's id is delivered, and the cut becomes
the *delivered* one. Every ``retention``, the leader deletes (one fenced statement, a scan of the
table) the rows older than the delivered cut it read one window before: a delivered row stays
between one and two windows. A long-running transaction holds the cut back, never forward.

A leader that stops cleanly deletes every row it knows delivered before it goes, with a *final*
cut: the oldest transaction id running then and the end of the log just after, as above; it reads
the stream on until the walsender reports having decoded past that end (a moment: the fence row's
update that follows writes to the log), so every transaction older than the cut's id was received.
Those the leader has not done (received, or half received, with records not acknowledged) are
older than the oldest xid among them; every other is done. So rows older than both that xid and the
cut's are delivered, and go; a switch back to mark-purge/reset republishes none of them. Not read
past the end in time (a stream gone), the stop deletes only the latest delivered cut's rows.
"""

from __future__ import annotations

import time
from typing import Protocol

from psycopg import sql

from harvester.core.protocols import StoreError
from harvester.postgres.log.parts import Ledger
from harvester.postgres.schema import migrations
from harvester.postgres.schema.identifiers import TableName

# How long, and in reads of how many messages, a leader that stops reads the stream on for its
# final cut (see the module's doc).
_FINAL_READ_SECONDS, _FINAL_READ_MESSAGES = 2.0, 5_000
# The final cut: the oldest transaction running now, and the end of the log just after.
_NOW = "SELECT txid_snapshot_xmin(txid_current_snapshot()), pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint"
# The lower of a cut and of the given 32-bit xids made 64-bit (against the current snapshot's xmax,
# which no received xid is above; a wrong guess could only make one lower).
_LOWEST = (
    "SELECT least(%s::bigint, min(s.top - ((s.top - x) %% 4294967296 + 4294967296) %% 4294967296))"
    " FROM (SELECT txid_snapshot_xmax(txid_current_snapshot()) AS top) AS s LEFT JOIN unnest(%s::bigint[]) AS x ON true"
    " GROUP BY s.top"
)

# Whether a row's inserting transaction (its 32-bit xmin made 64-bit against the current snapshot's
# xmax; a live row is less than a wraparound old) is older than the cut.
_OLDER = "s.top - ((s.top - {t}.xmin::text::bigint) %% 4294967296 + 4294967296) %% 4294967296 < %s"


class Position(Protocol):
    """The stored position a window is part of (:class:`~.position.StoredPosition`)."""

    def partial(self) -> tuple[int, int]: ...

    def store(self, lsn: int, position: int, partial: tuple[int, int] = (0, 0)) -> None: ...


class RetentionWindow:
    """Delivered rows deleted in bulk, at least ``retention`` seconds after their delivery."""

    def __init__(self, table: TableName, retention: float) -> None:
        fence_row = migrations.fence_table(table).ident
        self._retention = retention
        self._cut = 0  # the delivered cut read at the last sweep (0: none yet this term)
        self._next_sweep = 0.0  # monotonic time (mark thread)
        self._delivered = sql.SQL("SELECT log_delivered_xmin FROM {} WHERE outbox_table = %s AND shard = %s").format(
            fence_row
        )
        self._sweep_rows = sql.SQL(
            "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND shard = %s AND epoch = %s FOR SHARE),"
            " s AS (SELECT txid_snapshot_xmax(txid_current_snapshot()) AS top)"
            " DELETE FROM {t} USING s WHERE EXISTS (SELECT 1 FROM fence) AND " + _OLDER
        ).format(f=fence_row, t=table.ident)

    def bind(self, ledger: Ledger, position: Position) -> None:
        self._ledger, self._position = ledger, position

    def assignments(self) -> str:
        """More assignments of the position's UPDATE (``, col = …``, over ``f`` and ``v``): the cut
        moves on with the position: the pending one becomes the delivered one once the position
        reaches it, and a new one is taken (the right-hand sides see the old row)."""
        reached = "f.log_pending_lsn <= greatest(f.log_lsn, v.lsn)"
        return (
            ", log_delivered_xmin = CASE WHEN " + reached + " THEN f.log_pending_xmin ELSE f.log_delivered_xmin END,"
            " log_pending_xmin = CASE WHEN " + reached + " THEN txid_snapshot_xmin(txid_current_snapshot())"
            " ELSE f.log_pending_xmin END,"
            " log_pending_lsn = CASE WHEN " + reached + " THEN"
            " pg_wal_lsn_diff(pg_current_wal_insert_lsn(), '0/0')::bigint ELSE f.log_pending_lsn END"
        )

    def acquired(self) -> None:
        """The first sweep of the term only reads its cut."""
        self._cut, self._next_sweep = 0, time.monotonic() + self._retention

    def sweep(self) -> None:
        """After a mark: every ``retention`` the bulk delete."""
        if time.monotonic() >= self._next_sweep:
            self._next_sweep = time.monotonic() + self._retention
            cut, self._cut = self._cut, self._delivered_cut()
            if cut:
                self._delete_older(cut)

    def before_harvest(self) -> None:
        """A lost slot's recovery harvests what the table holds: the rows older than the delivered
        cut (the pending one first made delivered if the stored position reached it) are delivered,
        so they go first, and only the rest is published again (recovery.py)."""
        with self._ledger.state:
            partial = self._position.partial()
        self._position.store(0, 0, partial)
        cut = self._delivered_cut()
        if cut:
            self._delete_older(cut)

    def _delivered_cut(self) -> int:
        rows = self._ledger.db.run(self._delivered, self._ledger.fence.key)
        return int(rows[0][0]) if rows else 0

    def _delete_older(self, cut: int) -> int:
        """Delete (fenced) the rows whose inserting transaction is older than ``cut``."""
        cur = self._ledger.db.execute(self._sweep_rows, (*self._ledger.fence.guard, cut))
        if cur.rowcount == 0:
            self._ledger.fence.check_epoch()
        return cur.rowcount

    def close(self) -> None:
        """A leader that stops cleanly deletes what it knows delivered, window or not: the rows
        older than its final cut, or else than the latest delivered cut."""
        if self._ledger.fence.epoch:
            try:
                now = self._ledger.db.run(_NOW, ())[0]
                with self._ledger.state:
                    partial = self._position.partial()
                # The pending cut becomes the delivered one if reached.
                self._position.store(self._ledger.slot.advanced, 0, partial)
                cut = max(self._delivered_cut(), self._final_cut(int(now[0]), int(now[1])))
                if cut:
                    self._delete_older(cut)
            except StoreError:
                pass  # fenced, or the database is gone: the next leader's sweeps delete them

    def _final_cut(self, xmin: int, lsn: int) -> int:
        """The cut ``xmin``, taken with the end of the log at ``lsn``, lowered to the oldest
        transaction received and not done, once the stream was read past ``lsn`` (else 0)."""
        deadline = time.monotonic() + _FINAL_READ_SECONDS
        slot = self._ledger.slot
        while slot.streaming and slot.server_end < lsn and time.monotonic() < deadline:
            slot.wait(0.1)
            self._ledger.receive(slot.read_open(_FINAL_READ_MESSAGES))  # nothing, and no stream, if it broke
        if not slot.streaming or slot.server_end < lsn:
            return 0
        with self._ledger.state:
            xids = self._ledger.txns.unsettled_xids()
        return int(self._ledger.db.run(_LOWEST, (xmin, xids))[0][0])

"""A log source that deletes nothing per batch (the :class:`~harvester.postgres.log.parts.Finish`
of the table-less outbox, of Debezium's layout and of a retention window): how far its records are
done is stored in the outbox's fence row instead (``log_lsn``, the end of the last transaction whose
records are all done), under the epoch fence, before the slot is confirmed there. The table-less
outbox (:mod:`.messages`) has nothing to delete; a table with a retention window
(:mod:`.retention`) deletes later, in bulk.

A new leader skips every transaction up to the stored position, whether or not the old leader's
confirmation reached the server: at least once it republishes only what was not stored done;
exactly once the checkpoint position moves in that same statement, and only past checkpoints
whose transactions are stored done, so the rest are recovered from the checkpoint topic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace

from psycopg import sql

from harvester.core.protocols import FencedError, SourceSample
from harvester.postgres.log.parts import Ledger
from harvester.postgres.log.retention import RetentionWindow
from harvester.postgres.schema import migrations
from harvester.postgres.schema.identifiers import TableName


class StoredPosition:
    """Completions that store their position in the fence row instead of deleting rows; with
    ``window``, the delivered rows are deleted in bulk later."""

    def __init__(self, table: TableName, window: RetentionWindow | None = None) -> None:
        self._fence_row = migrations.fence_table(table).ident
        self._window = window
        self._store_done = self._store_statement()
        self._stored = sql.SQL(
            "SELECT log_lsn, log_partial_lsn, log_partial_count FROM {} WHERE outbox_table = %s AND shard = %s"
        ).format(self._fence_row)
        # The position this term stored done: the end of the last transaction all done, and the
        # done prefix of the next one, (its commit LSN, its length); guarded by the ledger's state.
        self._position: tuple[int, tuple[int, int]] = (0, (0, 0))
        self._following = False  # whether the transactions follow done records until stored

    def bind(self, ledger: Ledger) -> None:
        self._ledger = ledger
        if self._window is not None:
            self._window.bind(ledger, self)

    def _store_statement(self) -> sql.Composed:
        """The fenced UPDATE of the fence row; parameters: (lsn, partial LSN, partial count,
        checkpoint position, *fence, epoch). ``f`` is the row before the update, ``v`` the new
        position; (log_lsn, log_partial_lsn, log_partial_count) only moves forward, as a whole."""
        ahead = "(v.lsn, v.plsn, v.pcount) > (f.log_lsn, f.log_partial_lsn, f.log_partial_count)"
        return sql.SQL(
            "UPDATE {} AS f SET log_lsn = greatest(f.log_lsn, v.lsn),"
            f" log_partial_lsn = CASE WHEN {ahead} THEN v.plsn ELSE f.log_partial_lsn END,"
            f" log_partial_count = CASE WHEN {ahead} THEN v.pcount ELSE f.log_partial_count END,"
            " checkpoint_position = greatest(f.checkpoint_position, v.pos)"
            + ("" if self._window is None else self._window.assignments())
            + " FROM (SELECT %s::bigint AS lsn, %s::bigint AS plsn, %s::bigint AS pcount, %s::bigint AS pos) AS v"
            " WHERE f.outbox_table = %s AND f.shard = %s AND f.epoch = %s"
        ).format(self._fence_row)

    def acquired(self) -> None:
        """The term skips what an earlier one stored done."""
        ledger = self._ledger
        row = ledger.db.run(self._stored, ledger.fence.key)[0]
        done, partial = int(row[0]), (int(row[1]), int(row[2]))
        with ledger.state:
            ledger.txns.new_term(done, partial)
            self._position = (done, partial)
            self._following = False
        ledger.slot.confirm_on_start(done)
        if self._window is not None:
            self._window.acquired()

    def marked(self) -> None:
        if self._window is not None:
            self._window.sweep()

    def head(self) -> tuple[int, float | None]:
        """The records received and not done yet, and the age of the oldest of them (from its
        transaction's commit): the table, if any, holds delivered rows too (the slot's lag says what
        is not received yet)."""
        ledger = self._ledger
        with ledger.state:
            return ledger.txns.pending(), ledger.txns.oldest_age()

    def sample(self, sample: SourceSample, leads: bool) -> SourceSample:
        """Without a backlog unless this process leads: what a former leader received is stale."""
        return sample if leads else replace(sample, backlog=0, oldest_age=None, lag=0.0)

    def purge(self, ids: Sequence[int]) -> None:
        """Nothing deleted now: the records are done, and the position with them (the done prefix
        of the first transaction not all done included); the slot moves past every transaction all
        done."""
        ledger = self._ledger
        with ledger.state:
            if not self._following:  # at least once: durable() asks which purges are stored
                ledger.txns.follow_durable()
                self._following = True
        self.done(ids)

    def durable(self, ids: Sequence[int]) -> list[int]:
        """Of purged ``ids`` and of those kept back before, those the stored position covers (a new
        term skips them)."""
        ledger = self._ledger
        with ledger.state:
            lsn, partial = self._position
            out = ledger.txns.durable(ids, lsn, partial)
            if ledger.released:  # deleted by a lost slot's recovery (store.py)
                out += ledger.released
                ledger.released.clear()
            return out

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Exactly-once: store the checkpoint position and how far the transactions are done in one
        fenced statement (the position only past checkpoints whose transactions are all done),
        then confirm the slot there. Ids this term did not hand out (recovered from committed
        checkpoints) count as done when the slot sends them; the position stays."""
        ledger = self._ledger
        with ledger.state:
            target, reach, safe = ledger.checkpointed(ids, position)
            ledger.forget(ids)
        if target or safe:
            self.store(reach, safe)
        ledger.confirm(target)

    def done(self, ids: Sequence[int], *, purged: bool = True) -> None:
        ledger = self._ledger
        with ledger.state:
            target = ledger.completed(ids, follow=purged)
            partial = self.partial()
            ledger.forget(ids)
            now = (max(target, self._position[0]), partial)
            ahead = now > self._position
        if ahead:
            self.store(now[0], 0, partial)
        ledger.confirm(target)

    def advance_to(self, lsn: int) -> None:
        """Store ``lsn`` done under the fence (with the done prefix after it), then confirm the slot
        there."""
        with self._ledger.state:
            partial = self.partial()
        self.store(lsn, 0, partial)
        self._ledger.confirm(lsn)

    def before_harvest(self) -> None:
        if self._window is not None:
            self._window.before_harvest()

    def close(self) -> None:
        if self._window is not None:
            self._window.close()

    def partial(self) -> tuple[int, int]:
        """The done prefix to store, at least once (caller holds the ledger's state); exactly once,
        none."""
        return self._ledger.txns.partial() if self._following else (0, 0)

    def store(self, lsn: int, position: int, partial: tuple[int, int] = (0, 0)) -> None:
        """Store the position done (and the checkpoint ``position``) under the fence. A ``partial``
        of (0, 0) past the stored end drops the stored done prefix: store the current one where it
        may still hold."""
        ledger = self._ledger
        fence = ledger.fence
        cur = ledger.db.execute(self._store_done, (lsn, *partial, position, *fence.key, fence.epoch))
        if cur.rowcount == 0:
            raise FencedError(f"fenced: epoch {fence.epoch} superseded")
        with ledger.state:
            self._position = max(self._position, (lsn, partial))

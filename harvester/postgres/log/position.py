"""A log source that deletes nothing per batch: how far its records are done is stored in the
outbox's fence row instead (``log_lsn``, the end of the last transaction whose records are all
done), under the epoch fence, before the slot is confirmed there. Both the table-less outbox
(:mod:`harvester.postgres.log.message_store`, nothing to delete) and the table with a retention window
(:mod:`harvester.postgres.log.retention`, deleted later in bulk) complete records so.

A new leader skips every transaction up to the stored position, whether or not the old leader's
confirmation reached the server: at least once it republishes only what was not stored done;
exactly once the checkpoint position moves in that same statement, and only past checkpoints
whose transactions are stored done, so the rest are recovered from the checkpoint topic.
"""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import replace
from typing import Any
from uuid import UUID

from psycopg import sql

from harvester.core.protocols import FencedError, SourceSample
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.store import LogStore
from harvester.postgres.schema import migrations


class PositionedLogStore(LogStore):
    """:class:`LogStore` whose completions store their position in the fence row instead of
    deleting rows."""

    def __init__(self, dsn: str, setup: LogSetup, **options: Any) -> None:
        super().__init__(dsn, setup, **options)
        self._fence_row = migrations.fence_table(self.table).ident
        self._store_done = self._store_statement()
        self._stored = sql.SQL(
            "SELECT log_lsn, log_partial_lsn, log_partial_count FROM {} WHERE outbox_table = %s AND shard = %s"
        ).format(self._fence_row)
        # The position this term stored done: the end of the last transaction all done, and the
        # done prefix of the next one, (its commit LSN, its length); guarded by _state.
        self._position: tuple[int, tuple[int, int]] = (0, (0, 0))
        self._following = False  # whether the transactions follow done records until stored

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
            + self._also_set()
            + " FROM (SELECT %s::bigint AS lsn, %s::bigint AS plsn, %s::bigint AS pcount, %s::bigint AS pos) AS v"
            " WHERE f.outbox_table = %s AND f.shard = %s AND f.epoch = %s"
        ).format(self._fence_row)

    def _also_set(self) -> str:
        """More assignments of the same UPDATE (``, col = …``), over ``f`` and ``v``; none here."""
        return ""

    def acquire(self, leader_id: UUID) -> int:
        """As :meth:`LogStore.acquire`; the term skips what an earlier one stored done."""
        epoch = super().acquire(leader_id)
        row = self.db.run(self._stored, self.fence.key)[0]
        done, partial = int(row[0]), (int(row[1]), int(row[2]))
        with self._state:
            self._txns.new_term(done, partial)
            self._position = (done, partial)
            self._following = False
        self._slot.confirm_on_start(done)
        return epoch

    def head(self) -> tuple[int, float | None]:
        """The records received and not done yet, and the age of the oldest of them (from its
        transaction's commit): the table, if any, holds delivered rows too (the slot's lag says what
        is not received yet)."""
        with self._state:
            return self._txns.pending(), self._txns.oldest_age()

    def sample(self, leads: bool) -> SourceSample:
        """As :meth:`LogStore.sample`, without a backlog unless this process leads: what a former
        leader received is stale."""
        sample = super().sample(leads)
        return sample if leads else replace(sample, backlog=0, oldest_age=None, lag=0.0)

    def purge(self, ids: Sequence[int]) -> None:
        """Nothing deleted now: the records are done, and the position with them (the done prefix
        of the first transaction not all done included); the slot moves past every transaction all
        done. (While a lost slot is recovered, deleted as mark-purge does: recovery.py.)"""
        if self._table_purge(ids):
            return
        with self._state:
            if not self._following:  # at least once: durable() asks which purges are stored
                self._txns.follow_durable()
                self._following = True
        self._done(ids)

    def durable(self, ids: Sequence[int]) -> list[int]:
        """Of purged ``ids`` and of those kept back before, those the stored position covers (a new
        term skips them)."""
        with self._state:
            lsn, partial = self._position
            out = self._txns.durable(ids, lsn, partial)
            if self._released:  # deleted by a lost slot's recovery (store.py)
                out += self._released
                self._released.clear()
            return out

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Exactly-once: store the checkpoint position and how far the transactions are done in one
        fenced statement (the position only past checkpoints whose transactions are all done),
        then confirm the slot there. Ids this term did not hand out (recovered from committed
        checkpoints) count as done when the slot sends them; the position stays. (While a lost slot
        is recovered, deleted as mark-purge does: recovery.py.)"""
        if self._table_purge(ids, position):
            return
        with self._state:
            target, reach, safe = self._checkpointed(ids, position)
            self._drop_kept(ids)
        if target or safe:
            self._store(reach, safe)
        if target:
            self._confirm(target)

    def _drop_kept(self, ids: Sequence[int]) -> None:
        """``ids`` are done: drop what is kept about them (caller holds ``_state``)."""

    def _done(self, ids: Sequence[int], *, purged: bool = True) -> None:
        with self._state:
            target = self._completed(ids, follow=purged)
            partial = self._partial()
            self._drop_kept(ids)
            now = (max(target, self._position[0]), partial)
            ahead = now > self._position
        if ahead:
            self._store(now[0], 0, partial)
        if target:
            self._confirm(target)

    def _advance_to(self, lsn: int) -> None:
        """Store ``lsn`` done under the fence (with the done prefix after it), then confirm the slot
        there."""
        with self._state:
            partial = self._partial()
        self._store(lsn, 0, partial)
        self._confirm(lsn)

    def _partial(self) -> tuple[int, int]:
        """The done prefix to store, at least once (caller holds ``_state``); exactly once, none."""
        return self._txns.partial() if self._following else (0, 0)

    def _store(self, lsn: int, position: int, partial: tuple[int, int] = (0, 0)) -> None:
        """Store the position done (and the checkpoint ``position``) under the fence. A ``partial``
        of (0, 0) past the stored end drops the stored done prefix: store the current one where it
        may still hold."""
        cur = self.db.execute(self._store_done, (lsn, *partial, position, *self.fence.key, self.fence.epoch))
        if cur.rowcount == 0:
            raise FencedError(f"fenced: epoch {self.fence.epoch} superseded")
        with self._state:
            self._position = max(self._position, (lsn, partial))

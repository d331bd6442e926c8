"""A lost or invalidated replication slot, recovered without loss when the outbox is a table.

A slot is lost when a failover promotes a standby it was not synchronized to, when someone drops
it, or when the server invalidates it (``max_slot_wal_keep_size`` exceeded, a conflict on a
standby): ``pg_replication_slots`` then has no row for it, or ``wal_status = 'lost'``. The log
store notices at a term's take-over and when its stream starts again after it broke.

The WAL past the slot is gone, but the records are still rows. The leader first lets what the old
stream handed out settle (acknowledged ones are deleted; failed ones stay rows), or until none has
for a moment (a record handed out and dropped by a remark never settles). It marks the recovery under
way in the fence row (``log_recovery_id``, -1), creates a new slot at the current end of the log,
stores the table's highest id then as the recovery's head, and, before streaming, harvests the
table as mark-purge does (the polling store's mark, purge, checkpointed purge and dead-letter
statements, under the same fence and term) up to that head. A row the new slot will never show
committed before the slot was created: it was visible when the head was read, so its id is at most
the head. A row the harvest takes that the slot does show (committed after the slot's start) is
deleted before the stream starts, and the stream skips it as gone (the term's start, which
``TableRows.gone`` (rows.py) compares with, is moved past the harvest). Once nothing it handed out is
pending, the recovery mark is cleared (fenced) and the leader streams the new slot. A leader that
dies mid-recovery leaves the mark: the next one finishes the harvest first, so no new slot is
streamed while rows older than it wait in the table.

What the harvest publishes again, beyond what the slot had not delivered:

- Per-batch deletes: the rows still in the table are the records not delivered and those
  acknowledged but not deleted yet, at most ``KEY_RUN`` of a key, its latest, as after any crash:
  within what ``DedupReader`` drops. Exactly once, the term's checkpoint recovery deletes the rows
  of committed checkpoints before the harvest marks anything (a purge while a recovery is under way
  deletes, whatever the variant), so nothing committed to Kafka is published again.
- A retention window: delivered rows stay in the table. Those older than the delivered cut
  (retention.py) are deleted first; the rest are harvested, which repeats the records
  delivered since that cut was taken (usually the last second or so of the drain; a long-running
  transaction holds the cut back), in both delivery modes.
- A table-less outbox cannot be recovered: its records exist only in the log. The leader stops
  with one line that says so (:func:`unrecoverable`).
"""

from __future__ import annotations

import time
from collections.abc import Iterable, Iterator, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from uuid import UUID

import psycopg
import structlog
from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from psycopg import sql

from harvester.core.protocols import FatalStoreError, FencedError, StoreError
from harvester.core.records import MarkedRecord
from harvester.postgres.connections import Connections
from harvester.postgres.log import logical
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.parts import Finish, Ledger
from harvester.postgres.log.replication import StreamError
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table

log = structlog.get_logger("harvester.log_source")
# A lost slot's harvest waits for what the old stream handed out to settle while it does, or until
# none has for this long: a record handed out and then dropped (a failed statement's mark, a remark
# that dropped what waited behind its keys) never settles. Harvesting one still in flight repeats at
# most its key's run, as a crash would.
_DRAIN_QUIET_SECONDS = 2.0


class SlotLostError(StoreError):
    """The log source's slot is gone or invalidated."""


# undefined_object: the slot does not exist. object_not_in_prerequisite_state says it was
# invalidated ("can no longer get changes from replication slot"), and as much that the server
# cannot decode (wal_level below logical), that the slot is another database's or a physical one,
# or that a standby still synchronizes it (a connection that reached the standby in a promotion).
_UNDEFINED_OBJECT, _NOT_IN_PREREQUISITE_STATE = "42704", "55000"


def slot_lost(slot: str, exc: StreamError, db: Connections) -> str | None:
    """Whether a replication command's failure says that ``slot`` is lost, and how; None for any
    other failure (the stream is started again, then the engine retries with back-off, logging
    ``exc``). On object_not_in_prerequisite_state, the slot's ``wal_status`` tells an invalidated
    slot, recovered, from a server that cannot stream it now, whose recovery would only harvest the
    table again and again."""
    if exc.sqlstate == _UNDEFINED_OBJECT:
        return f"replication slot {slot} does not exist"
    if exc.sqlstate != _NOT_IN_PREREQUISITE_STATE:
        return None
    rows = db.run("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    if not rows:
        return f"replication slot {slot} does not exist"
    if rows[0][0] == "lost":
        return f"replication slot {slot} was invalidated by the server ({exc})"
    return None


def unrecoverable(lost: str) -> FatalStoreError:
    """The one line a table-less outbox stops with when its slot is lost (``lost`` says how)."""
    return FatalStoreError(
        f"{lost}: a table-less outbox's records exist only in the log, so records"
        " written since the slot was lost (or not yet read when it was) may be lost. Run 'reaper migrate' to"
        " create a new slot, which reads the records written from then on, and compare what the"
        " applications wrote in the meantime with what reached Kafka"
    )


@dataclass(frozen=True, slots=True)
class RecoveryStatements:
    """The fenced statements on the recovery mark of the fence row; each takes (outbox, shard, epoch)
    last, and returns the mark (no row: fenced)."""

    read: sql.Composed
    begin: sql.Composed
    restart: sql.Composed
    head: sql.Composed
    end: sql.Composed

    @classmethod
    def build(cls, table: TableName) -> RecoveryStatements:
        def update(value: str) -> sql.Composed:
            return sql.SQL(
                "UPDATE {f} SET log_recovery_id = " + value + " WHERE outbox_table = %s AND shard = %s AND epoch = %s"
                " RETURNING log_recovery_id"
            ).format(f=fence_table(table).ident, t=table.ident)

        return cls(
            read=sql.SQL("SELECT log_recovery_id FROM {} WHERE outbox_table = %s AND shard = %s AND epoch = %s").format(
                fence_table(table).ident
            ),
            begin=update("CASE WHEN log_recovery_id = 0 THEN -1 ELSE log_recovery_id END"),
            restart=update("-1"),
            # Read after the new slot exists: every row it will not show is visible to this statement.
            head=update(
                "CASE WHEN log_recovery_id = -1 THEN (SELECT coalesce(max(id), 0) FROM {t}) ELSE log_recovery_id END"
            ),
            end=update("0"),
        )


@dataclass(slots=True)
class Harvest:
    """A recovery under way in this term: the rows up to ``head`` harvested as mark-purge does."""

    why: str
    head: int = -1  # -1 until the new slot exists and the head is stored
    started: float = field(default_factory=time.monotonic)
    # What the lost slot's stream handed out and is not settled yet: the harvest marks nothing until
    # they are (their rows are deleted, or they failed and their rows are harvested), so it repeats none.
    draining: set[int] = field(default_factory=set)
    progress: float = field(default_factory=time.monotonic)  # when one of them last settled
    pending: set[int] = field(default_factory=set)  # the harvest's, handed out, not settled yet
    delivered: int = 0
    dead_lettered: int = 0

    def settled(self, ids: Iterable[int], *, delivered: bool = False, dead_lettered: bool = False) -> None:
        """``ids`` are no longer pending (delivered, dead-lettered, or to be marked again); the
        counts take those the harvest handed out."""
        if not self.draining.isdisjoint(ids):
            self.draining.difference_update(ids)
            self.progress = time.monotonic()
        mine = self.pending.intersection(ids)
        self.pending -= mine
        self.delivered += len(mine) if delivered else 0
        self.dead_lettered += len(mine) if dead_lettered else 0


class Harvesting(Ledger, Protocol):
    """What a lost slot's recovery uses of its log store, beyond what a part does: the polling
    store's mark and reset, and the start of the term the stream's reader compares with."""

    def mark_rows(self, leader_id: UUID, limit: int) -> list[MarkedRecord]: ...

    def reset_rows(self, ids: Sequence[int]) -> None: ...

    def start_term_here(self) -> None: ...


class LostSlot:
    """The recovery of a log store's lost slot (see the module's doc): begun at a take-over or a
    read that finds the slot lost, its harvest runs in the next marks. ``harvest`` (guarded by the
    store's ``state``) is the recovery under way in this term, if any."""

    def __init__(self, store: Harvesting, setup: LogSetup, finish: Finish, *, recoverable: bool) -> None:
        self._store, self._setup, self._finish, self._recoverable = store, setup, finish, recoverable
        self._statements = RecoveryStatements.build(setup.table)
        self.harvest: Harvest | None = None
        self.recoveries = 0  # lost slots recovered by this store (harvester_log_slot_recoveries)
        # Whether a leader of the outbox ever stored a position read from its slot.
        self._ever_read = sql.SQL("SELECT FROM {} WHERE outbox_table = %s AND log_lsn > 0").format(
            fence_table(setup.table).ident
        )

    def unless_recovered(self, problems: list[str]) -> list[str]:
        """At the store's preparation: ``problems`` of the log source's set-up but a missing slot
        that the leader recovers (a table's rows). A table-less outbox whose slot a leader read
        before stops (:func:`unrecoverable`)."""
        absent = f"replication slot {self._setup.slot} does not exist"
        if not any(p.startswith(absent) for p in problems):
            return problems
        if self._recoverable:  # a lost slot: the leader recovers it
            return [p for p in problems if not p.startswith(absent)]
        if self._store.db.run(self._ever_read, (self._setup.table.qualified,)):
            raise unrecoverable(absent)
        return problems

    def _fenced_mark(self, statement: sql.Composed) -> int:
        """Run one of the recovery mark's statements under the fence; the mark."""
        store = self._store
        rows = store.db.run(statement, store.fence.guard)
        if not rows:
            store.fence.check_epoch()
            raise FencedError(f"fenced: epoch {store.fence.epoch} superseded")
        return int(rows[0][0])

    def resume(self) -> None:
        """At a take-over that found the slot: resume the recovery an earlier leader left under way."""
        if self._fenced_mark(self._statements.read):
            self.begin(f"replication slot {self._setup.slot} was being recovered by an earlier leader")

    def begin(self, lost: str) -> None:
        """Begin (or resume) the recovery of a lost slot: marked under way in the fence row, its
        harvest then runs in the next marks. A table-less outbox stops instead."""
        if not self._recoverable:
            raise unrecoverable(lost)
        store = self._store
        store.slot.close()
        self._fenced_mark(self._statements.begin)
        with store.state:
            held = store.txns.held_ids()
        if held:  # delivered, waiting for the stored position to cover them: their rows go now
            store.delete_rows(held)
        with store.state:
            draining = store.txns.in_flight()
            store.txns.new_term()  # what the lost slot sent is in the table, or done
            self.harvest = Harvest(lost, draining=draining)
            store.released.update(held)
        log.info("log_slot_lost", slot=self._setup.slot, error=lost)

    def harvesting(self) -> Harvest | None:
        with self._store.state:
            return self.harvest

    def mark(self, harvest: Harvest, leader_id: UUID, limit: int) -> list[MarkedRecord] | None:
        """The next rows of the recovery's harvest, as mark-purge marks them; None once it is over
        (nothing left up to its head, nothing it handed out pending): the stream goes on then."""
        store = self._store
        with store.state:
            draining = bool(harvest.draining)
        if draining and time.monotonic() - harvest.progress < _DRAIN_QUIET_SECONDS:
            return []
        if harvest.head < 0:
            conn = store.db.conn()
            try:
                created = logical.recreate(conn, self._setup)
            except psycopg.OperationalError as exc:
                raise store.db.failed(conn, exc, time.monotonic()) from exc
            except psycopg.Error as exc:
                raise StoreError(f"creating the replication slot failed: {exc.sqlstate or type(exc).__name__}") from exc
            if created:  # a new slot: the head is read again after it (the first may have been lost too)
                self._fenced_mark(self._statements.restart)
            self._finish.before_harvest()
            harvest.head = self._fenced_mark(self._statements.head)
        batch = store.mark_rows(leader_id, limit) if harvest.head > 0 else []
        beyond = [r.id for r in batch if r.id > harvest.head]  # committed after the slot's start
        if beyond:
            store.reset_rows(beyond)  # not handed out here: the stream hands them out
        out = [r for r in batch if r.id <= harvest.head]
        with store.state:
            harvest.pending.update(r.id for r in out)
            busy = bool(harvest.pending)
        if out or busy:
            return out
        self._fenced_mark(self._statements.end)
        # The stream skips the rows the harvest deleted (rows.py): of transactions that committed before now.
        store.start_term_here()
        with store.state:
            self.harvest = None
        self.recoveries += 1
        log.warning(
            "log_slot_recovered",
            slot=self._setup.slot,
            error=harvest.why,
            head_id=harvest.head,
            delivered=harvest.delivered,
            dead_lettered=harvest.dead_lettered,
            seconds=round(time.monotonic() - harvest.started, 3),
        )
        return None

    def purge(self, ids: Sequence[int], position: int | None = None) -> bool:
        """While a recovery is under way, delete ``ids`` as mark-purge does (with the checkpoint
        ``position``, exactly once), whichever store handed them out: the lost slot's records in
        flight too, and the rows of committed checkpoints a new term recovers, so the harvest
        publishes none of them again. False when no recovery is under way."""
        harvest = self.harvesting()
        if harvest is None:
            return False
        self._store.delete_rows(ids, position)
        with self._store.state:
            harvest.settled(ids, delivered=True)
        return True


class SlotRecoveries(Collector):
    """``harvester_log_slot_recoveries``: how many lost slots ``store`` recovered (its count)."""

    def __init__(self, store: object) -> None:
        self._store = store

    def collect(self) -> Iterator[CounterMetricFamily]:
        yield CounterMetricFamily(
            "harvester_log_slot_recoveries",
            "Lost or invalidated replication slots replaced, their table's rows harvested (log source).",
            value=getattr(self._store, "slot_recoveries", 0),
        )

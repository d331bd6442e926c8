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
``LogStore._gone`` compares with, is moved past the harvest). Once nothing it handed out is
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
from collections.abc import Iterable, Iterator
from dataclasses import dataclass, field

from prometheus_client.core import CounterMetricFamily
from prometheus_client.registry import Collector
from psycopg import sql

from harvester.core.protocols import FatalStoreError, StoreError
from harvester.postgres.connections import Connections
from harvester.postgres.log.replication import StreamError
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table


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

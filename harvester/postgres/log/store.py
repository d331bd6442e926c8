"""The log source: the outbox's inserts read from a logical replication slot (``pgoutput`` over a
publication of the table), in commit order, instead of marked in the table.

The leader streams the slot (:mod:`harvester.postgres.log.slot`); the received transactions are
kept until all their records are done (:mod:`harvester.postgres.log.transactions`), then the done
prefix is confirmed to the server, which moves the slot. A confirmation follows a fenced statement
of the same round (the delete of the delivered rows, or an epoch check), and a new leader, once it
holds the newer epoch, terminates whatever walsender still reads the slot: a paused old leader that
wakes moves neither the slot nor the table. A new leader streams from where the slot stands: at
least once, it republishes what was not confirmed; exactly once, it first recovers the committed
checkpoints (their ids count as done when the slot sends them), and a record whose row an earlier
term deleted is skipped, so nothing committed to Kafka is published again. ``mark(leader_id, ...)``
keeps the engine's meaning: a new leader id starts a new pass over what is not done yet.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from dataclasses import replace
from typing import Any, TypeVar, cast
from uuid import UUID

import psycopg
import structlog
from psycopg import sql

from harvester.core.protocols import FencedError, SourceSample, StoreError
from harvester.core.records import Failure, MarkedRecord
from harvester.postgres.log import logical, pgoutput
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.records import Columns, outbox_record
from harvester.postgres.log.recovery import Harvest, RecoveryStatements, SlotLostError, slot_lost, unrecoverable
from harvester.postgres.log.replication import StreamError
from harvester.postgres.log.slot import SlotStream
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import Received
from harvester.postgres.log.transactions import Taken, Transaction, Transactions, messages, reached
from harvester.postgres.log.visibility import INVISIBLE_RECHECK, visible
from harvester.postgres.schema.migrations import fence_table
from harvester.postgres.table.store import PostgresStore

C = TypeVar("C")  # the columns a stream decoder reads inserts with

# Messages one read takes from the stream at most (completions wait for the stream meanwhile).
_READ_MESSAGES = 5_000
# An idle leader confirms how far the server decoded this often, so the slot moves past what other
# tables write while the outbox is idle; and once as soon as it is idle after handing records out.
_IDLE_CONFIRM_SECONDS = 10.0
# Read on while fewer records than this wait in the buffer, and at least this often in any case.
_READ_AHEAD = 20_000
_READ_SECONDS = 1.0
# A transaction still coming hands out what arrived after this long (it may come slowly).
_TRICKLE_SECONDS = 0.02
# A status update at least this often, whatever else happens, within the walsender's timeout, which
# the stream sets (PostgreSQL 12+; the default is 60 s).
_STATUS_SECONDS = 10.0
_SENDER_TIMEOUT = "30s"
# The encoding the decoding session sends text in (values come in their binary forms, whose text
# is in the client's encoding): fixed, whatever the server's default is.
_SESSION = "-c client_encoding=UTF8"

log = structlog.get_logger("harvester.log_source")
# A lost slot's harvest waits for what the old stream handed out to settle while it does, or until
# none has for this long: a record handed out and then dropped (a failed statement's mark, a remark
# that dropped what waited behind its keys) never settles. Harvesting one still in flight repeats at
# most its key's run, as a crash would.
_DRAIN_QUIET_SECONDS = 2.0


class LogStore(PostgresStore):
    """:class:`PostgresStore` whose records come from a logical replication slot."""

    # A key's barrier drops at the acknowledgement: a new term streams from the slot in commit order
    # and skips the rows already deleted, so a crash repeats a run of a key's latest records, in order.
    release_on_ack = True
    # A lost slot is recovered from the table's rows (recovery.py); a table-less outbox has none.
    _recoverable = True

    def __init__(
        self,
        dsn: str,
        setup: LogSetup,
        *,
        transaction_memory: int = 1 << 30,
        spill_directory: str | None = None,
        **options: Any,
    ) -> None:
        """``transaction_memory``: the memory (estimated) the transactions' records may take, all
        together, before a large one's next ones are spilled to a temporary file (spill.py), in
        ``spill_directory`` (None: the system's temporary directory)."""
        # No vacuum while a backlog drains: it keeps the head of the id index clean for the mark
        # query, and this store reads no rows (its deletes find theirs by id); autovacuum suffices.
        super().__init__(dsn, setup.table, **{**options, "vacuum_every": 0, "session_options": _SESSION})
        self._setup = setup
        # Shared by the streams and the received transactions.
        self._budget = Budget(transaction_memory, directory=spill_directory)
        self._slot = SlotStream(setup, self._take_over, self._stream_started, self._stream_decoder, self._budget)
        self._slot.conninfo = psycopg.conninfo.make_conninfo(
            dsn, connect_timeout=5, application_name=self.db.application_name, options=self.db.options
        )
        self.db.on_broken = self._slot.let_go
        self._outbox_oid = 0  # the table's oid, whose inserts the stream decoder decodes (0 until prepared)
        self._state = threading.Lock()  # guards everything below (mark and completion threads)
        self._txns = Transactions(b"I", b"", 1, budget=self._budget)  # the outbox's oid is known once prepared
        self._term_lsn = 0  # the end of the log when this term began
        self._present: sql.Composed | None = None
        # Exactly-once: (checkpoint position, its records' transactions) of purged batches whose
        # position is not stored yet.
        self._batches: deque[tuple[int, list[Transaction]]] = deque()
        self._next_idle_confirm = 0.0  # monotonic time (mark thread only)
        # Records went out since the last idle confirmation: the next one is due as soon as all are
        # done (what their completions wrote, deletes or the stored position, lies past them).
        self._handed_since_idle = False
        self._next_read = 0.0  # ... and the next read while records wait in the buffer
        self._takeover: sql.Composed | None = None
        self._recovery = RecoveryStatements.build(setup.table)
        self._harvest: Harvest | None = None  # a lost slot's recovery under way in this term
        self.slot_recoveries = 0  # lost slots recovered by this store (harvester_log_slot_recoveries)
        # Records done whose rows a recovery deleted, for durable() to report (a stored position
        # would have covered them): guarded by _state.
        self._released: set[int] = set()

    def prepare(self) -> Any:
        """As :meth:`PostgresStore.prepare`, and check that the slot and publication can be read."""
        columns = super().prepare()
        if self._takeover is None:
            conn, started = self.db.conn(), time.monotonic()
            try:
                problems = logical.missing(conn, self._setup)
            except psycopg.OperationalError as exc:
                raise self.db.failed(conn, exc, started) from exc
            except psycopg.Error as exc:
                raise StoreError(f"checking the log source failed: {exc.sqlstate or type(exc).__name__}") from exc
            absent = f"replication slot {self._setup.slot} does not exist"
            if any(p.startswith(absent) for p in problems):
                if self._recoverable:  # a lost slot: the leader recovers it (recovery.py)
                    problems = [p for p in problems if not p.startswith(absent)]
                elif self.db.run(self._ever_read, (self.table.qualified,)):
                    raise unrecoverable(absent)
            if problems:
                raise StoreError(f"log source: {problems[0]}")
            self._txns = self._outbox_messages()
            version = self.db.conn().info.server_version
            if version >= 120000:
                # A leader that reads nothing for this long (its in-flight window stuck while the
                # database shuts down) lets its walsender go, so the shutdown can finish; the stream
                # starts again on the next read.
                options = f"{self.db.options} -c wal_sender_timeout={_SENDER_TIMEOUT}"
                self._slot.conninfo = psycopg.conninfo.make_conninfo(self._slot.conninfo, options=options)
            self._takeover = logical.takeover(fence_table(self.table), version)
        return columns

    @property
    def _ever_read(self) -> sql.Composed:
        """Whether a leader of the outbox ever stored a position read from its slot."""
        return sql.SQL("SELECT FROM {} WHERE outbox_table = %s AND log_lsn > 0").format(fence_table(self.table).ident)

    def _outbox_messages(self) -> Transactions:
        """The bookkeeping of the outbox's messages in the stream: Inserts naming its table."""
        row = self.db.run("SELECT to_regclass(%s)::oid", (self.table.quoted,))
        oid = self._outbox_oid = int(row[0][0])
        self._present = sql.SQL("SELECT id FROM {} WHERE id = ANY(%s::bigint[])").format(self.table.ident)
        return Transactions(b"I", oid.to_bytes(4, "big"), 1, oid, self._budget)

    @property
    def tracks_attempts(self) -> bool:
        """False: a record read from the log carries no attempt count, the engine keeps it."""
        return False

    # ------------------------------------------------------------------ terms and reading

    def acquire(self, leader_id: UUID) -> int:
        """Bump the fence epoch, then take the slot over: the term streams from where it stands."""
        epoch = super().acquire(leader_id)
        # A previous leader deleted rows only before this bump: only transactions that committed
        # before it can hold records it delivered.
        row = self.db.run("SELECT pg_current_wal_lsn()::text", ())
        self._term_lsn = pgoutput.lsn_value(str(row[0][0]))
        lost: SlotLostError | None = None
        try:
            self._slot.take_over()
        except SlotLostError as exc:
            lost = exc
        with self._state:
            self._txns.new_term()
            self._batches.clear()
            self._harvest = None
        if lost is not None:
            self._recover(str(lost))
        elif self._fenced_mark(self._recovery.read):
            self._recover(f"replication slot {self._setup.slot} was being recovered by an earlier leader")
        return epoch

    def _take_over(self) -> int:
        """Terminate the slot's other reader under the fence; the slot's confirmed position."""
        assert self._takeover is not None
        found = self.db.run(self._takeover, (*self.fence.guard, self._setup.slot))
        if not found:
            self.fence.check_epoch()
            raise SlotLostError(f"replication slot {self._setup.slot} does not exist")
        if found[0][2]:
            raise SlotLostError(f"replication slot {self._setup.slot} was invalidated by the server (wal_status lost)")
        return pgoutput.lsn_value(str(found[0][0]))

    # ------------------------------------------------------------------ a lost slot (recovery.py)

    def _fenced_mark(self, statement: sql.Composed) -> int:
        """Run one of the recovery mark's statements under the fence; the mark."""
        rows = self.db.run(statement, self.fence.guard)
        if not rows:
            self.fence.check_epoch()
            raise FencedError(f"fenced: epoch {self.fence.epoch} superseded")
        return int(rows[0][0])

    def _recover(self, lost: str) -> None:
        """Begin (or resume) the recovery of a lost slot: marked under way in the fence row, its
        harvest then runs in the next marks. A table-less outbox stops instead."""
        if not self._recoverable:
            raise unrecoverable(lost)
        self._slot.close()
        self._fenced_mark(self._recovery.begin)
        with self._state:
            held = self._txns.held_ids()
        if held:  # delivered, waiting for the stored position to cover them: their rows go now
            PostgresStore.purge(self, held)
        with self._state:
            draining = self._txns.in_flight()
            self._txns.new_term()  # what the lost slot sent is in the table, or done
            self._harvest = Harvest(lost, draining=draining)
            self._released.update(held)
        log.info("log_slot_lost", slot=self._setup.slot, error=lost)

    def _harvesting(self) -> Harvest | None:
        with self._state:
            return self._harvest

    def _harvest_mark(self, harvest: Harvest, leader_id: UUID, limit: int) -> list[MarkedRecord] | None:
        """The next rows of the recovery's harvest, as mark-purge marks them; None once it is over
        (nothing left up to its head, nothing it handed out pending): the stream goes on then."""
        with self._state:
            draining = bool(harvest.draining)
        if draining and time.monotonic() - harvest.progress < _DRAIN_QUIET_SECONDS:
            return []
        if harvest.head < 0:
            conn = self.db.conn()
            try:
                created = logical.recreate(conn, self._setup)
            except psycopg.OperationalError as exc:
                raise self.db.failed(conn, exc, time.monotonic()) from exc
            except psycopg.Error as exc:
                raise StoreError(f"creating the replication slot failed: {exc.sqlstate or type(exc).__name__}") from exc
            if created:  # a new slot: the head is read again after it (the first may have been lost too)
                self._fenced_mark(self._recovery.restart)
            self._before_harvest()
            harvest.head = self._fenced_mark(self._recovery.head)
        batch = PostgresStore.mark(self, leader_id, limit) if harvest.head > 0 else []
        beyond = [r.id for r in batch if r.id > harvest.head]  # committed after the slot's start
        if beyond:
            PostgresStore.reset(self, beyond)  # not handed out here: the stream hands them out
        out = [r for r in batch if r.id <= harvest.head]
        with self._state:
            harvest.pending.update(r.id for r in out)
            busy = bool(harvest.pending)
        if out or busy:
            return out
        self._fenced_mark(self._recovery.end)
        # The stream skips the rows the harvest deleted (_gone): of transactions that committed before now.
        row = self.db.run("SELECT pg_current_wal_lsn()::text", ())
        self._term_lsn = pgoutput.lsn_value(str(row[0][0]))
        with self._state:
            self._harvest = None
        self.slot_recoveries += 1
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

    def _before_harvest(self) -> None:
        """Before the harvest's head is read: nothing here (a retention window deletes its delivered rows)."""

    def _table_purge(self, ids: Sequence[int], position: int | None = None) -> bool:
        """While a recovery is under way, delete ``ids`` as mark-purge does (with the checkpoint
        ``position``, exactly once), whichever store handed them out: the lost slot's records in
        flight too, and the rows of committed checkpoints a new term recovers, so the harvest
        publishes none of them again. False when no recovery is under way."""
        harvest = self._harvesting()
        if harvest is None:
            return False
        if position is None:
            PostgresStore.purge(self, ids)
        else:
            PostgresStore.purge_checkpointed(self, ids, position)
        with self._state:
            harvest.settled(ids, delivered=True)
        return True

    def _stream_started(self) -> None:
        with self._state:
            self._txns.stream_started()

    def mark(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Up to ``limit`` records in commit order, not yet handed out under ``leader_id``; while a
        lost slot is recovered, the table's rows (recovery.py)."""
        harvest = self._harvesting()
        if harvest is not None:
            rows = self._harvest_mark(harvest, leader_id, limit)
            if rows is not None:
                return rows
        with self._state:
            settled = self._txns.settled(self._slot.advanced)
        if settled:  # confirming failed after the last completion: again, before reading
            self._advance_to(settled)
        with self._state:
            self._txns.start_pass(leader_id)
            waiting = self._txns.waiting
        if not waiting:
            try:
                self._read(limit)
            except SlotLostError as exc:
                self._recover(str(exc))
                return []
        elif waiting < _READ_AHEAD or time.monotonic() > self._next_read:
            # Ahead while records go out; and the server's keepalives answered.
            self._next_read = time.monotonic() + _READ_SECONDS
            self._receive(self._slot.read_open(_READ_MESSAGES))
        # The stream is still wanted, however long the buffer takes to drain.
        self._slot.keep_alive(_STATUS_SECONDS)
        out = self._hand_out(leader_id, limit)
        with self._state:
            settled = self._txns.settled(self._slot.advanced)
            idle = (
                not out and self._txns.idle and (self._handed_since_idle or time.monotonic() > self._next_idle_confirm)
            )
        if out:
            self._handed_since_idle = True
        if settled and not out:
            self._advance_to(settled)
        if idle:
            self._confirm_idle()
        return out

    def _hand_out(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Up to ``limit`` buffered inserts not done yet, decoded only as they go out: a large
        transaction waits as bytes, not as a crowd of objects for the garbage collector."""
        out: list[MarkedRecord] = []
        while len(out) < limit:
            with self._state:
                taken = self._txns.take(leader_id, limit - len(out))
            if not taken:
                break
            if not visible(self.db.run, {txn for txn, _ in taken if not txn.visible}):
                with self._state:
                    self._txns.put_back(leader_id, taken)
                break
            out += self._fresh(taken)
        return out

    def _fresh(self, taken: Taken) -> list[MarkedRecord]:
        stamp = self.stamp()
        records = self._records(taken)
        gone = self._gone(taken, records)
        out: list[MarkedRecord] = []
        with self._state:
            handed_out = self._txns.handed_out
            for (txn, index), record in zip(taken, records, strict=True):
                rid = record.id
                if rid in gone:
                    txn.done.add(index)
                if handed_out(txn, index, rid):
                    record.stamp = stamp
                    out.append(record)
        return out

    def _records(self, taken: Taken) -> list[MarkedRecord]:
        """The records of outbox messages (Inserts), before the identity headers."""
        out: list[MarkedRecord] = []
        for (txn, _), insert in zip(taken, messages(taken), strict=True):
            if type(insert) is bytes:
                assert txn.columns is not None  # checked as the transaction came in
                out.append(outbox_record(insert, txn.columns))
            else:
                out.append(decoded(insert))
        return out

    def _stream_decoder(self) -> Callable[[bytes], MarkedRecord | None]:
        """The decoder of one transaction streamed in progress (streamed.py): its outbox inserts
        become records as they come, with the columns its own Relation message names (the walsender
        sends it in each streamed transaction, before its first change of the table). Decoding so,
        while the transaction is written, takes that work off the drain after its commit. An insert
        it fails on stays bytes (streamed.py): decoded at hand-out, as any other, where the error
        surfaces."""
        return stream_decoder(self._outbox_oid, Columns, outbox_record)

    def _gone(self, taken: Taken, records: list[MarkedRecord]) -> set[int]:
        """The ids of ``records`` an earlier term delivered and deleted, as the table says (again,
        they would be duplicates a de-duplicating reader may miss, their key having moved on)."""
        # By the commit record's start, known from the Begin: a superset of those ending before it.
        if not taken or taken[0][0].commit_lsn > self._term_lsn:
            return set()  # commit order: none of them committed before this term
        term = self._term_lsn
        earlier = [record.id for (txn, _), record in zip(taken, records, strict=True) if txn.commit_lsn <= term]
        return set(earlier) - self._existing(earlier)

    def _existing(self, ids: list[int]) -> set[int]:
        assert self._present is not None
        return {int(row[0]) for row in self.db.run(self._present, (ids,))}

    def _confirm_idle(self) -> None:
        """Confirm how far the server decoded, all received being done: the slot moves past what
        other tables wrote meanwhile, which an idle outbox would otherwise keep in the log. After
        records went out, tried on each idle mark until it moves the slot (the server's keepalives
        tell how far it decoded), then every :data:`_IDLE_CONFIRM_SECONDS`."""
        end = self._slot.server_end
        if end > self._slot.advanced:
            self._advance_to(end)
        elif self._handed_since_idle:
            return
        self._next_idle_confirm = time.monotonic() + _IDLE_CONFIRM_SECONDS
        self._handed_since_idle = False

    def _read(self, want: int) -> None:
        """Receive what the stream has, until ``want`` records wait, or a transaction came whole,
        or nothing more has arrived. While a transaction is half received (or streamed in part,
        before its commit), wait for more of it here: the walsender sends a large one at its own
        pace, a few messages per read, and ending the mark at each read made one mark per few
        records (75,000 while a 300,000-record transaction came in). What came within
        :data:`_TRICKLE_SECONDS` goes out then, whatever its number, and a read that receives
        nothing to hand out (nothing at all, or a transaction streamed in progress that keeps
        coming) ends after :data:`_READ_SECONDS`."""
        restarted = False
        started = time.monotonic()
        while True:
            self._next_read = time.monotonic() + _READ_SECONDS
            try:
                messages, drained = self._slot.read(_READ_MESSAGES)
            except StreamError as exc:
                lost = slot_lost(self._setup.slot, exc, self.db)
                if lost is not None:  # dropped or invalidated since the take-over looked
                    raise SlotLostError(lost) from exc
                # Broken (the server's wal_sender_timeout while nobody read, a restart): once more
                # from the slot's position, skipping what was received; then the engine's retry.
                if restarted:
                    raise
                restarted = True
                continue
            self._receive(messages)
            with self._state:
                waiting, receiving = self._txns.waiting, self._txns.receiving
            receiving = receiving or self._slot.in_progress
            now = time.monotonic()
            if waiting and (not receiving or waiting >= want or now - started > _TRICKLE_SECONDS):
                return
            if now - started > _READ_SECONDS:
                return
            if drained:
                left = started + (_TRICKLE_SECONDS if waiting else _READ_SECONDS) - now
                if not receiving or left <= 0 or not self._slot.wait(left):
                    return

    def _receive(self, messages: list[Received]) -> None:
        with self._state:
            self._txns.receive(messages)

    # ------------------------------------------------------------------ completion

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Exactly-once: delete the rows and move the checkpoint position (one fenced statement),
        then confirm every transaction whose records are all done. The position moves only past
        checkpoints whose transactions are confirmed by then: a checkpoint the position has passed
        is never recovered again (should the confirmation be lost, their rows are gone, which a
        new term's reader checks).

        A purge of ids this term did not hand out (the recovery of committed checkpoints) deletes
        their rows and remembers them as done; it leaves the position where it is."""
        if self._table_purge(ids, position):
            return
        with self._state:
            target, _, safe = self._checkpointed(ids, position)
        super().purge_checkpointed(ids, safe)
        if target:
            self._confirm(target)

    def _checkpointed(self, ids: Sequence[int], position: int) -> tuple[int, int, int]:
        """Exactly-once bookkeeping of the purged batch ``ids`` of checkpoint ``position`` (caller
        holds ``_state``): the position to confirm now (0: none), the position reached with it, and
        the newest checkpoint position whose transactions are all reached (0: none)."""
        batch = self._txns.transactions_of(ids)
        if batch:
            self._batches.append((position, batch))
        advanced = self._slot.advanced
        target = self._completed(ids)
        reach, safe = max(target, advanced), 0
        while self._batches and reached(self._batches[0][1], reach):
            safe = self._batches.popleft()[0]
        return target, reach, safe

    def purge(self, ids: Sequence[int]) -> None:
        """Delete delivered records (one fenced statement), then confirm every transaction whose
        records are all done."""
        if self._table_purge(ids):
            return
        super().purge(ids)
        self._done(ids)

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        """Move the rows into the dead-letter table; they count as done for the slot."""
        super().dead_letter(failures, leader_id)
        ids = [f.id for f in failures]
        harvest = self._harvesting()
        if harvest is not None:
            with self._state:
                harvest.settled(ids, dead_lettered=True)
            return
        self._done(ids, purged=False)

    def reset(self, ids: Sequence[int]) -> None:
        """Nothing in the table: the records stay in memory and the next pass hands them out again
        (a recovery's harvest marks them again, as mark-purge does)."""
        harvest = self._harvesting()
        if harvest is not None:
            PostgresStore.reset(self, ids)
            with self._state:
                harvest.settled(ids)

    def fail(self, failures: Sequence[Failure]) -> None:
        """Nothing in the table (attempts are counted in memory, see :attr:`tracks_attempts`)."""
        self.reset([f.id for f in failures])

    def _done(self, ids: Sequence[int], *, purged: bool = True) -> None:
        """After a fenced statement about ``ids`` succeeded: they are done (``purged``: delivered, as
        opposed to dead-lettered, whose key no run waits for)."""
        with self._state:
            target = self._completed(ids, follow=purged)
        if target:
            self._confirm(target)

    def _completed(self, ids: Sequence[int], *, follow: bool = True) -> int:
        """:meth:`Transactions.completed` (caller holds ``_state``); a recovery that began since
        the statement about ``ids`` was sent no longer waits for them (recovery.py)."""
        if self._harvest is not None:
            self._harvest.settled(ids)
        return self._txns.completed(ids, self._slot.advanced, follow=follow)

    def _advance_to(self, lsn: int) -> None:
        """Confirm ``lsn`` after checking, in a fenced statement, that the epoch is still ours."""
        self.fence.check_epoch()
        self._confirm(lsn)

    def _confirm(self, lsn: int) -> None:
        """Report everything before ``lsn`` consumed; call only right after a fenced statement
        found the epoch current. No error reaches the caller: the records are done either way (a
        stream that broke meanwhile is followed by one that reports it when it starts)."""
        self._slot.confirm(lsn)

    def wait_for_insert(self, timeout: float) -> bool:
        """Until the stream has something to read (or, before it started, as the mark-purge store).
        While a received transaction waits to become visible (:mod:`.visibility`), at most
        ``INVISIBLE_RECHECK``: the stream may stay quiet, and the engine's idle back-off would hold
        its records back for as long."""
        if not self._slot.streaming:
            return super().wait_for_insert(timeout)
        with self._state:
            waiting = self._txns.waiting
        if waiting:
            self._slot.wait(min(timeout, INVISIBLE_RECHECK))
            return True
        return self._slot.wait(timeout)

    def sample(self, leads: bool) -> SourceSample:
        """The meter's sample (:class:`~harvester.core.protocols.SourceGauges`): the table's head; the
        lag this leader holds of what it received (``leads``: the commit of the oldest transaction with
        records not done, from its own bookkeeping); the slot's bytes (not consumed, retained), when
        they can be read."""
        backlog, age = self.head()
        with self._state:
            received = self._txns.oldest_age() if leads else None
        try:
            state = logical.slot_state(self.db.conn(), self._setup.slot)
        except (psycopg.Error, StoreError):
            state = None
        return SourceSample(backlog, age, max(age or 0.0, received or 0.0), None if state is None else state[:2])

    def close(self) -> None:
        """Stop streaming, forget what was received (removing its spill files) and close every
        connection."""
        self._slot.close()
        with self._state:
            self._txns.new_term()
        super().close()


def decoded(kept: Received) -> MarkedRecord:
    """The record a stream decoder kept (:meth:`LogStore._stream_decoder`), to hand out: itself the
    first time; a copy after, since the record handed out before (it has its stamp) may still be in
    flight."""
    record = cast(MarkedRecord, kept)
    return record if record.stamp is None else replace(record, headers=list(record.headers), stamp=None)


def stream_decoder(
    oid: int, columns_of: Callable[[pgoutput.Relation], C], record: Callable[[bytes, C], MarkedRecord]
) -> Callable[[bytes], MarkedRecord | None]:
    """A streamed transaction's decoder for the table ``oid``: its inserts become ``record``s with the
    columns ``columns_of`` reads from the transaction's latest Relation message of the table."""
    match = oid.to_bytes(4, "big")
    columns: C | None = None

    def decode(change: bytes) -> MarkedRecord | None:
        nonlocal columns
        kind = change[0]
        if kind == 0x49:  # Insert
            if columns is None or not change.startswith(match, 1):
                return None
            return record(change, columns)
        if kind == 0x52:  # Relation
            relation = pgoutput.parse(change)
            if isinstance(relation, pgoutput.Relation) and relation.oid == oid:
                columns = None  # until it is read: a layout the store cannot read raises here
                columns = columns_of(relation)
        return None

    return decode

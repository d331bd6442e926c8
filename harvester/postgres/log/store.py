"""The log source: the outbox's inserts read from a logical replication slot (``pgoutput`` over a
publication of the table), in commit order, instead of marked in the table.

The leader streams the slot (:mod:`harvester.postgres.log.slot`); the received transactions are kept
until all their records are done (:mod:`harvester.postgres.log.transactions`), then the done prefix
is confirmed to the server, which moves the slot. A confirmation follows a fenced statement of the
same round (the finish part's delete of the delivered rows or stored position, or an epoch check),
and a new leader, once it holds the newer epoch, terminates whatever walsender still reads the slot:
a paused old leader that wakes moves neither the slot nor the table. A new leader streams from where
the slot stands: at least once, it republishes what was not confirmed; exactly once, it first
recovers the committed checkpoints (their ids count as done when the slot sends them), and a record
whose row an earlier term deleted is skipped, so nothing committed to Kafka is published again.
``mark(leader_id, ...)`` keeps the engine's meaning: a new leader id starts a new pass over what is
not done yet.
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from harvester.core.protocols import SourceSample, StoreError
from harvester.core.records import Failure, MarkedRecord
from harvester.postgres.log import logical, pgoutput
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.parts import Decoding, Finish, Rows
from harvester.postgres.log.reading import Reader
from harvester.postgres.log.recovery import LostSlot, SlotLostError
from harvester.postgres.log.slot import SlotStream
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import ChangeDecoder, Received
from harvester.postgres.log.transactions import Taken, Transaction, Transactions, reached
from harvester.postgres.log.visibility import visible
from harvester.postgres.schema.catalog import OutboxColumns
from harvester.postgres.schema.migrations import fence_table
from harvester.postgres.table.store import PostgresStore

# The walsender's timeout the stream sets (PostgreSQL 12+; the default is 60 s), above the reader's
# status interval (reading.py).
_SENDER_TIMEOUT = "30s"
# How much of its transactions' changes the walsender holds before it streams the largest (protocol
# 2, streaming: a transaction in progress), set on the stream's session before the DSN's options
# (which may choose another). With the server's default, 64 MB, up to 64 MB of a large transaction
# that the walsender had decoded were still to send at its commit; in 1 MB steps what it decoded has
# reached the harvester by then, its CPU per record falls a little and it holds 1 MB per stream
# instead of 64 (docs/benchmarks.md, "Decoded in 1 MB steps, purged by a bitmap").
DECODING_OPTIONS = "-c logical_decoding_work_mem=1MB"
# The encoding the decoding session sends text in (values come in their binary forms, whose text
# is in the client's encoding): fixed, whatever the server's default is.
_SESSION = "-c client_encoding=UTF8"


class LogStore(PostgresStore):
    """:class:`PostgresStore` whose records come from a logical replication slot, composed of its
    :mod:`~harvester.postgres.log.parts` (:func:`harvester.compose.log_store` picks them)."""

    def __init__(
        self,
        dsn: str,
        setup: LogSetup,
        *,
        decoding: Decoding,
        finish: Finish,
        rows: Rows,
        transaction_memory: int = 1 << 30,
        spill_directory: str | None = None,
        **options: Any,
    ) -> None:
        """``decoding``, ``finish``, ``rows``: how the stream's messages become records, how records
        done are made durable, whether they are rows of the table too (:mod:`.parts`).
        ``transaction_memory``: the memory (estimated) the transactions' records may take, all
        together, before a large one's next ones are spilled to a temporary file (spill.py), in
        ``spill_directory`` (None: the system's temporary directory)."""
        # No vacuum while a backlog drains: it keeps the head of the id index clean for the mark
        # query, and this store reads no rows (its deletes find theirs by id); autovacuum suffices.
        # A key's barrier drops at the acknowledgement: a new term streams from the slot in commit order
        # and skips the rows already deleted, so a crash repeats a run of a key's latest records, in order.
        options = {**options, "vacuum_every": 0, "session_options": _SESSION, "release_on_ack": True}
        super().__init__(dsn, setup.table, **options)
        self._setup = setup
        self._decoding, self._finish, self._rows = decoding, finish, rows
        # Shared by the streams and the received transactions.
        self._budget = Budget(transaction_memory, directory=spill_directory)
        self.slot = SlotStream(setup, self._take_over, self._stream_started, self._stream_decoder, self._budget)
        self.slot.conninfo = psycopg.conninfo.make_conninfo(
            dsn, connect_timeout=5, application_name=self.db.application_name, options=self.db.options
        )
        self.db.on_broken = self.slot.let_go
        self._outbox_oid = 0  # the table's oid, whose inserts the stream decoder decodes (0 until prepared)
        # Guards txns, _batches, released and the lost slot's harvest (mark and completion threads).
        self.state = threading.Lock()
        self.txns = Transactions(b"I", b"", 1, budget=self._budget)  # the outbox's oid is known once prepared
        self._term_lsn = 0  # the end of the log when this term began
        # Exactly-once: (checkpoint position, its records' transactions) of purged batches whose
        # position is not stored yet.
        self._batches: deque[tuple[int, list[Transaction]]] = deque()
        self._reader = Reader(self, finish, setup.slot, self.db)
        self._takeover: sql.Composed | None = None
        self._lost = LostSlot(self, setup, finish, recoverable=rows.recoverable)
        # Records done whose rows a recovery deleted, for durable() to report (a stored position
        # would have covered them): guarded by state.
        self.released: set[int] = set()
        finish.bind(self)
        rows.bind(self)

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
            problems = self._lost.unless_recovered(problems)
            if problems:
                raise StoreError(f"log source: {problems[0]}")
            self.txns = self._outbox_messages()
            version = self.db.conn().info.server_version
            if version >= 120000:
                # A leader that reads nothing for this long (its in-flight window stuck while the
                # database shuts down) lets its walsender go, so the shutdown can finish; the stream
                # starts again on the next read.
                options = f"{self.db.options} -c wal_sender_timeout={_SENDER_TIMEOUT}"
                if version >= 140000:  # streaming
                    options = f"{DECODING_OPTIONS} {options}"
                self.slot.conninfo = psycopg.conninfo.make_conninfo(self.slot.conninfo, options=options)
            self._takeover = logical.takeover(fence_table(self.table), version)
        self._rows.prepared(self._setup)
        return columns

    def _read_columns(self, conn: psycopg.Connection[Any]) -> OutboxColumns:
        return self._decoding.columns(conn, self.table)

    def _outbox_messages(self) -> Transactions:
        """The bookkeeping of the outbox's messages in the stream (of its table's, if it has one)."""
        if self._decoding.reads_table:
            row = self.db.run("SELECT to_regclass(%s)::oid", (self.table.quoted,))
            self._outbox_oid = int(row[0][0])
        return self._decoding.transactions(self._outbox_oid, self._budget)

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
        self.start_term_here()
        lost: SlotLostError | None = None
        try:
            self.slot.take_over()
        except SlotLostError as exc:
            lost = exc
        with self.state:
            self.txns.new_term()
            self._batches.clear()
            self._lost.harvest = None
        if lost is not None:
            self._lost.begin(str(lost))
        else:
            self._lost.resume()
        self._finish.acquired()
        return epoch

    def start_term_here(self) -> None:
        """The stream's records of transactions that committed before now may be gone (rows.py)."""
        row = self.db.run("SELECT pg_current_wal_lsn()::text", ())
        self._term_lsn = pgoutput.lsn_value(str(row[0][0]))

    @property
    def slot_recoveries(self) -> int:
        """Lost slots recovered by this store (harvester_log_slot_recoveries)."""
        return self._lost.recoveries

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

    def _stream_started(self) -> None:
        with self.state:
            self.txns.stream_started()

    def mark(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Up to ``limit`` records in commit order, not yet handed out under ``leader_id``; while a
        lost slot is recovered, the table's rows (recovery.py)."""
        out = self._mark(leader_id, limit)
        self._finish.marked()
        return out

    def _mark(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        harvest = self._lost.harvesting()
        if harvest is not None:
            rows = self._lost.mark(harvest, leader_id, limit)
            if rows is not None:
                return rows
        with self.state:
            settled = self.txns.settled(self.slot.advanced)
        if settled:  # confirming failed after the last completion: again, before reading
            self._finish.advance_to(settled)
        with self.state:
            self.txns.start_pass(leader_id)
            waiting = self.txns.waiting
        if not waiting:
            try:
                self._reader.read(limit)
            except SlotLostError as exc:
                self._lost.begin(str(exc))
                return []
        self._reader.ahead(waiting)
        out = self._hand_out(leader_id, limit)
        self._reader.handed_out(out)
        return out

    def _hand_out(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Up to ``limit`` buffered inserts not done yet, decoded only as they go out: a large
        transaction waits as bytes, not as a crowd of objects for the garbage collector."""
        out: list[MarkedRecord] = []
        while len(out) < limit:
            with self.state:
                taken = self.txns.take(leader_id, limit - len(out))
            if not taken:
                break
            if not visible(self.db.run, {txn for txn, _ in taken if not txn.visible}):
                with self.state:
                    self.txns.put_back(leader_id, taken)
                break
            out += self._fresh(taken)
        return out

    def _fresh(self, taken: Taken) -> list[MarkedRecord]:
        stamp = self.stamp()
        records = self._decoding.records(taken)
        gone = self._rows.gone(taken, records, self._term_lsn)
        with self.state:
            skipped = self.txns.handed_out(taken, [record.id for record in records], gone)
            out = [record for record in records if record.id not in skipped] if skipped else records
            for record in out:
                record.stamp = stamp
            self._rows.handed_out(out)
        return out

    def _stream_decoder(self) -> ChangeDecoder:
        """The decoder of one transaction streamed in progress (streamed.py)."""
        return self._decoding.stream_decoder(self._outbox_oid)

    def receive(self, messages: list[Received]) -> None:
        with self.state:
            self.txns.receive(messages)

    # ------------------------------------------------------------------ completion

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Exactly-once: as the finish part does (:mod:`.parts`). A purge of ids this term did not
        hand out (the recovery of committed checkpoints) deletes their rows and remembers them as
        done; it leaves the position where it is."""
        if not self._lost.purge(ids, position):
            self._finish.purge_checkpointed(ids, position)

    def checkpointed(self, ids: Sequence[int], position: int) -> tuple[int, int, int]:
        """Exactly-once bookkeeping of the purged batch ``ids`` of checkpoint ``position`` (caller
        holds ``state``): the position to confirm now (0: none), the position reached with it, and
        the newest checkpoint position whose transactions are all reached (0: none)."""
        batch = self.txns.transactions_of(ids)
        if batch:
            self._batches.append((position, batch))
        advanced = self.slot.advanced
        target = self.completed(ids)
        reach, safe = max(target, advanced), 0
        while self._batches and reached(self._batches[0][1], reach):
            safe = self._batches.popleft()[0]
        return target, reach, safe

    def purge(self, ids: Sequence[int]) -> None:
        """Delivered records are done, as the finish part makes them (a delete, a stored position);
        while a lost slot is recovered, deleted as mark-purge does (recovery.py)."""
        if not self._lost.purge(ids):
            self._finish.purge(ids)

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        """Dead-letter the records (the rows part moves the rows, or writes what it kept); they
        count as done for the slot."""
        if not self._rows.dead_letter(failures, leader_id):
            return
        ids = [f.id for f in failures]
        harvest = self._lost.harvesting()
        if harvest is not None:
            with self.state:
                harvest.settled(ids, dead_lettered=True)
            return
        self._finish.done(ids, purged=False)

    def reset(self, ids: Sequence[int]) -> None:
        """Nothing in the table: the records stay in memory and the next pass hands them out again
        (a recovery's harvest marks them again, as mark-purge does)."""
        harvest = self._lost.harvesting()
        if harvest is not None:
            self.reset_rows(ids)
            with self.state:
                harvest.settled(ids)

    def fail(self, failures: Sequence[Failure]) -> None:
        """Nothing in the table (attempts are counted in memory, see :attr:`tracks_attempts`)."""
        self.reset([f.id for f in failures])

    def completed(self, ids: Sequence[int], *, follow: bool = True) -> int:
        """:meth:`Transactions.completed` (caller holds ``state``); a recovery that began since
        the statement about ``ids`` was sent no longer waits for them (recovery.py)."""
        harvest = self._lost.harvest
        if harvest is not None:
            harvest.settled(ids)
        return self.txns.completed(ids, self.slot.advanced, follow=follow)

    def confirm(self, lsn: int) -> None:
        """Report everything before ``lsn`` (0: nothing) consumed; call only right after a fenced
        statement found the epoch current. No error reaches the caller: the records are done either
        way (a stream that broke meanwhile is followed by one that reports it when it starts)."""
        if lsn:
            self.slot.confirm(lsn)

    def mark_rows(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Mark the table's rows as mark-purge does (a lost slot's harvest)."""
        return PostgresStore.mark(self, leader_id, limit)

    def reset_rows(self, ids: Sequence[int]) -> None:
        """Make the rows of ``ids`` eligible for the next :meth:`mark_rows` (mark-purge's reset)."""
        PostgresStore.reset(self, ids)

    def forget(self, ids: Sequence[int]) -> None:
        """``ids`` are done: the rows part drops what it kept of them (caller holds ``state``)."""
        self._rows.forget(ids)

    def delete_rows(self, ids: Sequence[int], position: int | None = None) -> None:
        """Delete the rows of ``ids`` as mark-purge does (with the checkpoint ``position``, exactly
        once), under the fence."""
        if position is None:
            PostgresStore.purge(self, ids)
        else:
            PostgresStore.purge_checkpointed(self, ids, position)

    def move_dead_letters(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        """Move the rows into the dead-letter table, as mark-purge does."""
        PostgresStore.dead_letter(self, failures, leader_id)

    def table_head(self) -> tuple[int, float | None]:
        """The table's head, as mark-purge samples it."""
        return PostgresStore.head(self)

    def head(self) -> tuple[int, float | None]:
        """The backlog and its oldest record's age, as the finish part knows them."""
        return self._finish.head()

    def durable(self, ids: Sequence[int]) -> list[int]:
        """Of purged ``ids`` (and of those kept back before), those a new term would skip."""
        return self._finish.durable(ids)

    def wait_for_insert(self, timeout: float) -> bool:
        """Until the stream has something to read (:meth:`.reading.Reader.wait`); before it
        started, as the mark-purge store."""
        if not self.slot.streaming:
            return super().wait_for_insert(timeout)
        return self._reader.wait(timeout)

    def sample(self, leads: bool) -> SourceSample:
        """The meter's sample (:class:`~harvester.core.protocols.SourceGauges`): the head, as the
        finish part knows it; the lag this leader holds of what it received (``leads``: the commit of
        the oldest transaction with records not done, from its own bookkeeping); the slot's bytes (not
        consumed, retained), when they can be read."""
        backlog, age = self.head()
        with self.state:
            received = self.txns.oldest_age() if leads else None
        try:
            state = logical.slot_state(self.db.conn(), self._setup.slot)
        except (psycopg.Error, StoreError):
            state = None
        sample = SourceSample(backlog, age, max(age or 0.0, received or 0.0), None if state is None else state[:2])
        return self._finish.sample(sample, leads)

    def close(self) -> None:
        """Stop streaming, forget what was received (removing its spill files) and close every
        connection (after the finish part's last work: a retention window's final sweep)."""
        self._finish.close()
        self.slot.close()
        with self.state:
            self.txns.new_term()
        super().close()

"""The log source: the outbox's inserts read from a logical replication slot (``pgoutput`` over a
publication of the table), in commit order, instead of marked in the table.

Reading: ``pg_logical_slot_peek_binary_changes`` returns whole committed transactions from the
slot's position on, without moving it. The store keeps the transactions it read, in commit order,
until every record of each is done (acknowledged and deleted, or dead-lettered); then it advances
the slot past the done prefix with ``pg_replication_slot_advance``. The advance and the deletes run
under the epoch fence, so a fenced process moves neither the slot nor the table; a new leader starts
reading where the slot stands: at least once, it republishes whatever the slot was not advanced
past; exactly once, it first recovers the committed checkpoints (their ids count as done when the
slot returns them), so nothing committed to Kafka is published again.

``mark(leader_id, ...)`` keeps the engine's meaning: it hands out records not yet handed out under
``leader_id``. A new leader id (a new term, or a forced remark after a failure) starts a new pass
over the slot, which hands out every record of the unadvanced transactions that is not done yet.
Within a pass a peek skips the transactions already handed out; while the slot has more than a mark
batch of records to advance past, the next peek waits for their completion rather than read them all
again.

Why the SQL functions and not the streaming replication protocol: psycopg 3 does not speak the
replication protocol, and the functions run on the store's ordinary connections (with the fence in
the same statement as the advance). The price: each peek and advance decodes the log again from the
slot's restart position (docs/log-source.md).
"""

from __future__ import annotations

import threading
import time
from collections import deque
from collections.abc import Sequence
from dataclasses import dataclass, field
from datetime import UTC, datetime
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from harvester.core.protocols import StoreError
from harvester.core.records import Failure, MarkedRecord
from harvester.postgres import logical, pgoutput, rows
from harvester.postgres.logical import LogSetup
from harvester.postgres.migrations import fence_table
from harvester.postgres.store import PostgresStore

# Changes (messages) one peek returns at most; it always ends at a transaction's end.
_PEEK_CHANGES = 20_000
# An idle leader writes a keepalive transaction this often, so the slot moves on an idle outbox.
_KEEPALIVE_SECONDS = 10.0
# Text forms the decoding session writes values in: fixed, whatever the server's defaults are.
_SESSION = "-c DateStyle=ISO -c TimeZone=UTC -c bytea_output=hex"


@dataclass(slots=True, eq=False)
class _Transaction:
    end_lsn: int
    size: int  # the outbox inserts it holds
    done: set[int] = field(default_factory=set)  # ids acknowledged (or dead-lettered)

    @property
    def settled(self) -> bool:
        return len(self.done) >= self.size


@dataclass(slots=True, eq=False)
class _Segment:
    """Consecutive buffered inserts of one transaction."""

    txn: _Transaction
    columns: _Columns
    left: int


class _Columns:
    """Where the outbox's columns are in a Relation message's tuple."""

    def __init__(self, relation: pgoutput.Relation) -> None:
        index = {name: i for i, name in enumerate(relation.columns)}
        try:
            self.id, self.time, self.topic, self.key, self.value, self.hkeys, self.hvalues = (
                index[c] for c in logical.PUBLISHED
            )
        except KeyError as exc:
            raise StoreError(f"the published outbox has no column {exc.args[0]}") from None


class LogStore(PostgresStore):
    """:class:`PostgresStore` whose records come from a logical replication slot."""

    def __init__(self, dsn: str, setup: LogSetup, **options: Any) -> None:
        super().__init__(dsn, setup.table, **options)
        self._setup = setup
        self._options = f"{self._options} {_SESSION}"
        self._slot_lock = threading.Lock()  # one reader of the slot at a time in this process
        self._state = threading.Lock()  # guards everything below (mark and completion threads)
        self._pass: UUID | None = None  # the leader id of the current pass over the slot
        self._buffer: deque[bytes] = deque()  # Insert messages read in this pass, not yet handed out
        self._segments: deque[_Segment] = deque()  # ... and whose they are
        self._read_upto = 0  # end LSN of the last transaction read in this pass
        self._transactions: deque[_Transaction] = deque()  # read, not yet advanced past
        self._by_end: dict[int, _Transaction] = {}
        self._of_id: dict[int, _Transaction] = {}
        self._unsettled = 0  # records of self._transactions, which every peek returns again
        # Ids done although this term never handed them out (committed checkpoints a new term
        # recovers; completions of the previous term): skipped when the slot returns them.
        self._recovered: set[int] = set()
        self._advanced = 0  # where this term last moved the slot to
        self._settled_upto = 0  # the end of the last transaction this term forgot as settled
        self._term_lsn = 0  # the end of the log when this term began
        self._present: sql.Composed | None = None
        # Exactly-once: (checkpoint position, end LSN of its last transaction) of purged batches
        # whose position is not stored yet.
        self._batches: deque[tuple[int, int]] = deque()
        self._columns: _Columns | None = None  # from the outbox's latest Relation message
        self._deferred = threading.Event()  # clear while a peek waits for completions
        self._deferred.set()
        self._defer_below = 0  # ... until at most this many records are unsettled
        self._oid = 0  # the outbox table's oid, as Relation and Insert messages name it
        self._next_keepalive = 0.0  # monotonic time (mark thread only)
        self._peek: sql.Composed | None = None
        self._advance: sql.Composed | None = None

    def prepare(self) -> Any:
        """As :meth:`PostgresStore.prepare`, and check that the slot and publication can be read."""
        columns = super().prepare()
        if self._peek is None:
            try:
                problems = logical.missing(self._conn(), self._setup)
            except psycopg.Error as exc:
                raise StoreError(f"checking the log source failed: {exc.sqlstate or type(exc).__name__}") from exc
            if problems:
                raise StoreError(f"log source: {problems[0]}")
            row = self._run("SELECT to_regclass(%s)::oid", (self._table.quoted,))
            self._oid = int(row[0][0])
            self._peek = sql.SQL(
                "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, %s,"
                " 'proto_version', '1', 'publication_names', %s, 'messages', 'true')"
            ).format()
            self._present = sql.SQL("SELECT id FROM {} WHERE id = ANY(%s::bigint[])").format(self._table.ident)
            # The fence row stays share-locked while the slot moves: a newer epoch's bump waits for it.
            self._advance = sql.SQL(
                "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND shard = %s AND epoch = %s FOR SHARE)"
                " SELECT pg_replication_slot_advance(s.slot_name, greatest(%s::pg_lsn, s.confirmed_flush_lsn))"
                " FROM fence, pg_replication_slots s WHERE s.slot_name = %s"
            ).format(f=fence_table(self._table).ident)
        return columns

    @property
    def tracks_attempts(self) -> bool:
        """False: a record read from the log carries no attempt count, the engine keeps it."""
        return False

    # ------------------------------------------------------------------ terms and reading

    def acquire(self, leader_id: UUID) -> int:
        """Bump the fence epoch; the term reads from the slot's position as it is now."""
        epoch = super().acquire(leader_id)
        # A previous leader deleted rows only before this bump: only transactions that committed
        # before it can hold records it delivered.
        row = self._run("SELECT pg_current_wal_lsn()::text", ())
        self._term_lsn = pgoutput.lsn_value(str(row[0][0]))
        with self._state:
            self._pass = None
            self._buffer.clear()
            self._segments.clear()
            self._transactions.clear()
            self._by_end.clear()
            self._of_id.clear()
            self._unsettled = 0
            self._settled_upto = 0
            self._batches.clear()
        self._deferred.set()
        return epoch

    def mark(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Up to ``limit`` records in commit order, not yet handed out under ``leader_id``."""
        with self._state:
            settled = self._settled()
        if settled:  # moving the slot failed after the last completion: again, before reading
            self._advance_to(settled)
        with self._state:
            if self._pass != leader_id:
                self._pass, self._read_upto = leader_id, 0
                self._buffer.clear()
                self._segments.clear()
            elif not self._buffer and self._unsettled > limit:
                # Most of what a peek would return is handed out already: wait for completions.
                self._defer_below = limit
                self._deferred.clear()
                return []
        if not self._buffer:
            self._read(leader_id)
        out = self._hand_out(leader_id, limit)
        with self._state:
            settled = self._settled()
            keepalive = not out and not self._transactions and time.monotonic() > self._next_keepalive
        if settled and not out:
            self._advance_to(settled)
        if keepalive:
            self._keepalive()
        return out

    def _hand_out(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Decode the next ``limit`` buffered inserts: only as they go out, so a large transaction
        waits in the buffer as bytes, not as a crowd of objects for the garbage collector."""
        taken: list[tuple[_Segment, bytes]] = []
        with self._state:
            if self._pass != leader_id:
                return []
            while len(taken) < limit and self._buffer:
                segment = self._segments[0]
                taken.append((segment, self._buffer.popleft()))
                segment.left -= 1
                if not segment.left:
                    self._segments.popleft()
        names, kind = self._names, self._ready().columns.limits.value_kind
        identity = ((names.epoch, str(self._epoch).encode()), (names.producer, self._ready().producer))
        records = [(seg.txn, _record(pgoutput.insert_values(data), seg.columns, kind)) for seg, data in taken]
        # A record of a transaction an earlier term read may have been delivered and its row
        # deleted: the table says so (publishing it again would be a duplicate the de-duplicating
        # reader cannot be sure to catch, its key having moved on).
        earlier = [record.id for txn, record in records if txn.end_lsn <= self._term_lsn]
        gone = set(earlier) - self._existing(earlier) if earlier else set()
        out: list[MarkedRecord] = []
        with self._state:
            for txn, record in records:
                if record.id in self._recovered or record.id in gone:
                    self._recovered.discard(record.id)
                    txn.done.add(record.id)
                if record.id in txn.done:
                    continue  # done in an earlier pass, waiting for the rest of its transaction
                record.headers += ((names.id, str(record.id).encode()), *identity)
                self._of_id[record.id] = txn
                out.append(record)
        return out

    def _existing(self, ids: list[int]) -> set[int]:
        assert self._present is not None
        return {int(row[0]) for row in self._run(self._present, (ids,))}

    def _keepalive(self) -> None:
        """Write a transaction the slot sees (an empty logical message): when it has been read, the
        slot advances past it, and so past whatever other tables wrote meanwhile, which an idle
        outbox would otherwise keep in the log."""
        self._next_keepalive = time.monotonic() + _KEEPALIVE_SECONDS
        self._run("SELECT pg_logical_emit_message(true, 'outbox-harvester', '')", ())

    def _read(self, leader_id: UUID) -> None:
        assert self._peek is not None
        setup = self._setup
        with self._slot_lock:
            rows = self._run(self._peek, (setup.slot, _PEEK_CHANGES, setup.publication))
        oid = self._oid.to_bytes(4, "big")
        with self._state:
            if self._pass != leader_id:
                return
            self._read_upto = max(self._read_upto, self._settled_upto)  # settled: never again
            inserts: list[bytes] = []
            skipping = False  # through a transaction this pass handed out already
            for (data,) in rows:
                if data[:1] == b"I":
                    if not skipping and data[1:5] == oid:
                        inserts.append(data)
                    continue
                message = pgoutput.parse(data)
                if isinstance(message, pgoutput.Begin):
                    inserts = []
                    skipping = message.final_lsn < self._read_upto
                elif isinstance(message, pgoutput.Relation) and message.oid == self._oid:
                    self._columns = _Columns(message)
                elif isinstance(message, pgoutput.Commit) and message.end_lsn > self._read_upto:
                    self._read_upto = message.end_lsn
                    txn = self._by_end.get(message.end_lsn)
                    if txn is None:
                        txn = _Transaction(message.end_lsn, len(inserts))
                        self._unsettled += txn.size
                        self._transactions.append(txn)
                        self._by_end[txn.end_lsn] = txn
                    if inserts:
                        if self._columns is None:
                            raise StoreError("the slot sent inserts of the outbox before its relation")
                        self._segments.append(_Segment(txn, self._columns, len(inserts)))
                        self._buffer.extend(inserts)

    # ------------------------------------------------------------------ completion

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Exactly-once: advance the slot past every transaction whose records are all done (one
        fenced statement), then delete the rows and move the checkpoint position (a second one),
        but only past checkpoints whose transactions the slot is past: a checkpoint the position
        has passed is never recovered again, so the slot must not return its records any more.

        A purge of ids this term did not hand out (the recovery of committed checkpoints) deletes
        their rows and remembers them as done; it leaves the position where it is."""
        with self._state:
            ends = [txn.end_lsn for rid in ids if (txn := self._of_id.get(rid)) is not None]
            if ends:
                self._batches.append((position, max(ends)))
        self._done(ids)
        safe = 0
        with self._state:
            while self._batches and self._batches[0][1] <= self._advanced:
                safe = self._batches.popleft()[0]
        super().purge_checkpointed(ids, safe)

    def purge(self, ids: Sequence[int]) -> None:
        """Delete delivered records (one fenced statement), then advance the slot past every
        transaction whose records are all done (a second one)."""
        super().purge(ids)
        self._done(ids)

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        """Move the rows into the dead-letter table; they count as done for the slot."""
        super().dead_letter(failures, leader_id)
        self._done([f.id for f in failures])

    def reset(self, ids: Sequence[int]) -> None:
        """Nothing in the table: the records stay in the slot and the next pass reads them again."""

    def fail(self, failures: Sequence[Failure]) -> None:
        """Nothing in the table (attempts are counted in memory, see :attr:`tracks_attempts`)."""

    def _done(self, ids: Sequence[int]) -> None:
        with self._state:
            for rid in ids:
                txn = self._of_id.pop(rid, None)
                if txn is not None:
                    txn.done.add(rid)
                else:
                    self._recovered.add(rid)
            target = self._settled()
            if self._unsettled <= self._defer_below:
                self._deferred.set()
        if target:
            self._advance_to(target)

    def _settled(self) -> int:
        """Forget the leading transactions whose records are all done; where the slot should move
        to, if it is not there yet (else 0; caller holds ``_state``). A forgotten transaction is
        never handed out again, even if moving the slot past it failed: the next call retries."""
        while self._transactions and self._transactions[0].settled:
            txn = self._transactions.popleft()
            del self._by_end[txn.end_lsn]
            self._unsettled -= txn.size
            self._settled_upto = txn.end_lsn
        return self._settled_upto if self._settled_upto > self._advanced else 0

    def _advance_to(self, lsn: int) -> None:
        assert self._advance is not None
        params = (*self._fence, self._epoch, pgoutput.lsn_text(lsn), self._setup.slot)
        with self._slot_lock:
            rows = self._run(self._advance, params)
        if not rows:
            self._check_epoch()
            raise StoreError(f"replication slot {self._setup.slot} does not exist")
        with self._state:
            self._advanced = max(self._advanced, lsn)

    def wait_for_insert(self, timeout: float) -> bool:
        """After a deferred peek, until records complete; otherwise as the mark-purge store waits."""
        if not self._deferred.is_set():
            return self._deferred.wait(timeout)
        return super().wait_for_insert(timeout)

    def slot_bytes(self) -> tuple[int, int] | None:
        """(WAL bytes not consumed by the slot, WAL bytes it retains), or None without the slot."""
        try:
            return logical.slot_bytes(self._conn(), self._setup.slot)
        except psycopg.Error as exc:
            raise StoreError(f"reading the slot failed: {exc.sqlstate or type(exc).__name__}") from exc


def _record(values: tuple[bytes | None, ...], c: _Columns, kind: str) -> MarkedRecord:
    """A decoded insert as the engine publishes it, before the identity headers."""
    raw = values[c.value]
    # A textual value's text form is the bytes Kafka carries; bytea's is hex (\x...).
    value = bytes.fromhex(raw[2:].decode()) if raw is not None and kind == "bytes" else raw
    raw_keys, raw_values = values[c.hkeys], values[c.hvalues]
    headers: list[tuple[str, str | bytes | None]] = []
    why = None
    if raw_keys != b"{}" or raw_values != b"{}":
        hkeys = pgoutput.text_array(None if raw_keys is None else raw_keys.decode())
        hvalues = pgoutput.text_array(None if raw_values is None else raw_values.decode())
        why = rows.malformed("", hkeys, hvalues)
        headers = [
            (k or "", v.encode() if v is not None else b"") for k, v in zip(hkeys or (), hvalues or (), strict=False)
        ]
    key = values[c.key]
    if key is None:
        why = rows.malformed(None, [], [])
    created = values[c.time]
    return MarkedRecord(
        int(values[c.id] or 0),
        datetime.fromisoformat(created.decode()) if created else datetime.now(UTC),
        (values[c.topic] or b"").decode(),
        key.decode() if key is not None else "",
        value,
        headers,
        malformed=why,
    )

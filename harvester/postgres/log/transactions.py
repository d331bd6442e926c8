"""The log source's bookkeeping of received transactions: what the slot sent, in commit order, what
of it is done, and the pass buffer of what a leader id has not been handed yet.

Not thread-safe: :class:`~harvester.postgres.log.store.LogStore` calls it under its state lock (the
mark thread receives and hands out, completion threads settle).

A transaction is kept from its Begin until every record of it is done (acknowledged and deleted,
or dead-lettered) and its Commit came; the leading run of settled transactions is then forgotten,
and the end LSN of the last one is where the slot may be confirmed to. Its records are handed out
as they arrive, before its Commit: the walsender sends a transaction only once it committed, and a
large one takes seconds to come (about 150,000 records a second), which the drain overlaps. A new
pass (a new leader id) refills the buffer with every record of the kept transactions (from memory:
the stream goes forward only); records already done are skipped as they are handed out.

Records are known by where they are in their transaction (the stream's order, which the slot sends
again the same): the leading run of a transaction's done records is its *done prefix*, which a
store that keeps the position done instead of deleting rows (:mod:`harvester.postgres.log.position`)
stores too, so that a new leader skips it even when an earlier record of another key is not done.
"""

from __future__ import annotations

import time
from collections import deque
from collections.abc import Callable, Collection, Iterable, Sequence
from dataclasses import dataclass, field
from heapq import heappop, heappush
from uuid import UUID

from harvester.core.protocols import StoreError
from harvester.postgres.log import pgoutput
from harvester.postgres.log.records import Columns
from harvester.postgres.log.spill import MESSAGE_COST, Budget, Spill
from harvester.postgres.log.streamed import SPILLED, Received

_EPOCH_2000 = 946_684_800.0  # PostgreSQL's timestamps count from 2000-01-01 UTC, in Unix seconds


@dataclass(slots=True, eq=False)
class Transaction:
    commit_lsn: int  # where its commit record starts (its Begin says)
    xid: int
    columns: Columns | None
    # Its outbox messages (or what a decoder kept of them, streamed.py), kept until all are done (a
    # new pass re-reads them): in memory, then, past the memory limit, in a spill (spill.py).
    inserts: list[Received]
    done: set[int] = field(default_factory=set)  # indexes in inserts of those acknowledged (or dead-lettered)
    prefix: int = 0  # how many of its first inserts are all done (advanced by Transactions.partial)
    visible: bool = False  # its rows were found visible to new snapshots (see harvester.postgres.log.visibility)
    commit_time: int = 0  # microseconds since 2000-01-01 UTC
    end_lsn: int = 0  # a slot advanced to here has consumed it; 0 until its Commit came
    in_memory: int = 0  # what its inserts in memory take (estimated, spill.py), as counted in the budget
    spill: Spill | None = None  # its inserts past the budget
    # Inserts a restarted stream decoded past where the spill began (see receive), by index.
    apart: dict[int, Received] | None = None

    @property
    def size(self) -> int:
        return len(self.inserts) + (len(self.spill) if self.spill is not None else 0)

    @property
    def settled(self) -> bool:
        return self.end_lsn > 0 and len(self.done) >= self.size

    def spilled(self, start: int, stop: int) -> list[Received]:
        """Its outbox messages from ``start`` to ``stop`` (excluded), all past those in memory, in
        one read of its spill."""
        assert self.spill is not None
        base = len(self.inserts)
        out: list[Received] = list(self.spill.read(start - base, stop - base))
        if self.apart is not None:
            for index, kept in self.apart.items():
                if start <= index < stop:
                    out[index - start] = kept
        return out


def reached(transactions: Iterable[Transaction], lsn: int) -> bool:
    """Whether every one of ``transactions`` came whole and ends at or before ``lsn``."""
    return all(0 < txn.end_lsn <= lsn for txn in transactions)


# Records handed out: their transactions and their indexes in its inserts.
Taken = list[tuple[Transaction, int]]


def messages(taken: Taken) -> list[Received]:
    """The outbox messages (or what a decoder kept of them) of ``taken``, from memory or, past it,
    from their transactions' spills, a run of consecutive ones in one read."""
    out: list[Received | None] = [txn.inserts[i] if i < len(txn.inserts) else None for txn, i in taken]
    gaps = [at for at, message in enumerate(out) if message is None]
    g = 0
    while g < len(gaps):
        at = gaps[g]
        txn, first = taken[at]
        run = 1
        while g + run < len(gaps) and gaps[g + run] == at + run and taken[at + run] == (txn, first + run):
            run += 1
        out[at : at + run] = txn.spilled(first, first + run)
        g += run
    return out


class Transactions:
    """The received, unconfirmed transactions of one term, and the current pass over them.

    ``kind`` and ``match`` say which messages are the outbox's: those whose first byte is ``kind``
    and whose bytes from ``at`` are ``match`` (an Insert naming the outbox's oid; a logical message
    with the outbox's prefix). What the transactions hold in memory is counted in ``budget``'s
    ``received`` (spill.py); once it is over, a transaction past its floor spills its next messages."""

    def __init__(
        self,
        kind: bytes,
        match: bytes,
        at: int,
        oid: int = 0,
        budget: Budget | None = None,
        columns_of: Callable[[pgoutput.Relation], Columns] = Columns,
    ) -> None:
        """``columns_of``: how the outbox's Relation message is read (another layout's reader)."""
        self._kind, self._match, self._at, self._end = kind, match, at, at + len(match)
        self._columns_of = columns_of
        self._budget = budget or Budget()
        self._oid = oid  # the outbox table's oid, whose Relation messages name its columns (0: none)
        self.columns: Columns | None = None  # from the outbox's latest Relation message
        self._pass: UUID | None = None  # the leader id of the current pass
        self._buffer: deque[tuple[Transaction, int]] = deque()  # received, not handed out in this pass
        self._received_upto = 0  # end LSN of the last transaction received in this term
        self.kept: deque[Transaction] = deque()  # received, not yet confirmed past
        self._of_id: dict[int, tuple[Transaction, int]] = {}  # handed out, not done
        # Done and not yet known to be stored done, when asked to follow (see durable()): their ids,
        # and a heap of (commit LSN, index, id), the order in which a stored position covers them.
        self._held: set[int] | None = None
        self._held_order: list[tuple[int, int, int]] = []
        # Ids done although this term never handed them out (committed checkpoints a new term
        # recovers; completions of the previous term): skipped when the slot sends them.
        self._recovered: set[int] = set()
        self._settled_upto = 0  # the end of the last transaction this term forgot as settled
        self._open: Transaction | None = None  # the transaction being received (kept already)
        # The stream is sending a transaction this term received before (skipped): its messages may
        # span reads, and none of them belongs to the open one (a restarted stream sends those before it).
        self._skipping = False
        # How much it may hold before it spills: the budget's room for it as of its Begin (the
        # walsender sends nothing else until its Commit, so what the others hold can only shrink
        # meanwhile), and at least the floor. Computed once: a message only compares.
        self._spill_at = 0
        self._skip = 0  # its inserts a restarted stream sends again (received before)
        self._partial = (0, 0)  # (commit LSN, done prefix) of a transaction a new term skips a part of

    def new_term(self, done_upto: int = 0, partial: tuple[int, int] = (0, 0)) -> None:
        """Forget everything received: a new term streams again from the slot's position, skipping
        the transactions that end at or before ``done_upto`` (known done), and the first
        ``partial[1]`` records of the one whose commit starts at ``partial[0]``."""
        self._pass = None
        self._buffer.clear()
        self._received_upto = done_upto
        for txn in self.kept:
            self._forget(txn)
        self.kept.clear()
        self._of_id.clear()
        if self._held is not None:
            self._held.clear()
            self._held_order.clear()
        self._settled_upto = 0
        self._open = None
        self._skip = 0
        self._skipping = False
        self._partial = partial

    def follow_durable(self) -> None:
        """Remember done records until :meth:`durable` finds them stored done."""
        self._held = set()

    def stream_started(self) -> None:
        """A new stream begins at a transaction boundary: a half-received transaction comes again
        from its Begin, and the inserts received before are skipped."""
        self._skipping = False
        if self._open is not None:
            self._skip = self._open.size

    # ------------------------------------------------------------------ the pass

    def start_pass(self, leader_id: UUID) -> None:
        """A new leader id hands out again every record of the kept transactions."""
        if self._pass != leader_id:
            self._pass = leader_id
            self._buffer = deque((txn, i) for txn in self.kept for i in range(txn.size))

    @property
    def idle(self) -> bool:
        """Nothing kept and no transaction half received: every transaction the server sent is done.
        (A keepalive in the middle of a large transaction may report its end already.)"""
        return not self.kept and self._open is None

    @property
    def receiving(self) -> bool:
        """A transaction is half received: its Begin came, its Commit not yet."""
        return self._open is not None

    @property
    def waiting(self) -> int:
        """Records received and not handed out in this pass."""
        return len(self._buffer)

    def take(self, leader_id: UUID, limit: int) -> Taken:
        """Of the next ``limit`` buffered records of the pass of ``leader_id`` (none under another)
        that are not all done already, those not done. (A record taken is not done until it is handed
        out: its transaction is not settled, its messages are there to read, its spill not removed.)"""
        if self._pass != leader_id:
            return []
        buffer = self._buffer
        while buffer:
            taken = [buffer.popleft() for _ in range(min(limit, len(buffer)))]
            if left := [entry for entry in taken if entry[1] not in entry[0].done]:
                return left
        return []

    def put_back(self, leader_id: UUID, taken: Taken) -> None:
        """Return records :meth:`take` gave, to go out first (unless the pass changed meanwhile)."""
        if self._pass == leader_id:
            self._buffer.extendleft(reversed(taken))

    def handed_out(self, taken: Taken, ids: Sequence[int], gone: Collection[int] = frozenset()) -> set[int]:
        """``taken``'s records, whose ids are ``ids``, go out but those done already (in an earlier
        pass, recovered, or in ``gone``: their rows are gone), whose ids it returns (usually none);
        the others are remembered as in flight. One call per batch: it runs per record."""
        recovered, of_id, skipped = self._recovered, self._of_id, set()
        for (txn, index), rid in zip(taken, ids, strict=True):
            if (gone and rid in gone) or (recovered and rid in recovered):
                recovered.discard(rid)
                txn.done.add(index)
            if index in txn.done:
                skipped.add(rid)
            else:
                of_id[rid] = (txn, index)
        return skipped

    def in_flight(self) -> set[int]:
        """The ids of the records handed out and not done yet."""
        return set(self._of_id)

    def unsettled_xids(self) -> list[int]:
        """The xids of the received transactions not all done, one half received included."""
        return [txn.xid for txn in self.kept if not txn.settled]

    def pending(self) -> int:
        """Records received and not done yet."""
        return sum(txn.size - len(txn.done) for txn in self.kept)

    def oldest_age(self) -> float | None:
        """Seconds since the commit of the oldest received transaction not all done, by this host's
        clock against the server's commit timestamp (None: every received one is done). The leading
        settled ones are forgotten at each completion, so this looks at one or two."""
        commit = next((txn.commit_time for txn in self.kept if not txn.settled), None)
        return None if commit is None else max(0.0, time.time() - _EPOCH_2000 - commit / 1e6)

    def transactions_of(self, ids: Iterable[int]) -> list[Transaction]:
        """The transactions of the in-flight records among ``ids`` (see :func:`reached`)."""
        return list({at[0] for rid in ids if (at := self._of_id.get(rid)) is not None})

    # ------------------------------------------------------------------ receiving

    def receive(self, messages: Iterable[Received]) -> None:
        """Keep the outbox's messages of each transaction as they come, skipping transactions this
        term received already (a restarted stream sends them again). What is not bytes is what a
        decoder kept of an outbox message (streamed.py), counted by its stream: at a Begin, the
        count a stream handed over at its commit is taken into the transaction's."""
        kind, match, at, oid, budget = self._kind[0], self._match, self._at, self._oid, self._budget
        txn = None if self._skipping else self._open
        buffer, spill_at = self._buffer, self._spill_at
        for data in messages:
            if type(data) is not bytes or data[0] == kind:
                if txn is not None and (type(data) is not bytes or data.startswith(match, at)):
                    if self._skip:
                        self._skip -= 1
                        continue
                    if oid and txn.columns is None:
                        raise StoreError("the slot sent inserts of the outbox before its relation")
                    spill = txn.spill
                    if spill is None:
                        index = len(txn.inserts)
                        txn.inserts.append(data)
                        if type(data) is bytes:  # what was decoded, its stream counted (handed over)
                            cost = len(data) + MESSAGE_COST
                            txn.in_memory += cost
                            budget.received += cost
                            if txn.in_memory > spill_at:
                                txn.spill = budget.spill()
                    else:
                        index = len(txn.inserts) + len(spill)
                        if type(data) is bytes:
                            spill.append(data)
                        else:  # decoded by a restarted stream that reached its limit later than the first
                            spill.append(b"")
                            txn.apart = txn.apart or {}
                            txn.apart[index] = data
                    if index < txn.prefix:  # stored done by an earlier term
                        txn.done.add(index)
                    else:
                        buffer.append((txn, index))
                continue
            if data == SPILLED:  # what follows of a streamed transaction was spilled: so is it here
                if txn is not None and txn.spill is None:
                    txn.spill = budget.spill()
                continue
            message = pgoutput.parse(data)
            if isinstance(message, pgoutput.Begin):
                txn = self._begin(message)
                self._skipping = txn is None
                if budget.handed:  # a streamed one's: its stream's count passes to the memory it is in
                    if txn is not None:  # else received before: its messages are skipped
                        txn.in_memory += budget.handed
                        budget.received += budget.handed
                    budget.handed = 0
                if txn is not None:
                    spill_at = self._spill_at = budget.room(txn.in_memory)
            elif isinstance(message, pgoutput.Relation) and message.oid == oid:
                self.columns = self._columns_of(message)
                if txn is not None:
                    txn.columns = self.columns
            elif isinstance(message, pgoutput.Commit):
                if txn is not None:
                    txn.end_lsn = self._received_upto = message.end_lsn
                    self._open, self._skip = None, 0
                txn, self._skipping = None, False

    def _begin(self, message: pgoutput.Begin) -> Transaction | None:
        """The transaction a Begin opens, kept (and open until its Commit); None when this term
        received it already."""
        if message.final_lsn < self._received_upto:
            return None
        # A transaction half received when the stream restarted is sent again: the inserts received
        # before are skipped. Another cannot come first (the slot was not confirmed past it); should
        # it, the half-received one stays kept and never settles: the slot stops before it (its lag
        # alert fires) rather than move past records that never came.
        if self._open is not None and self._open.commit_lsn == message.final_lsn:
            return self._open
        self._skip = 0
        txn = self._open = Transaction(
            message.final_lsn, message.xid, self.columns, [], commit_time=message.commit_time
        )
        if message.final_lsn == self._partial[0]:
            txn.prefix = self._partial[1]
        self.kept.append(txn)
        return txn

    # ------------------------------------------------------------------ completion

    def completed(self, ids: Sequence[int], advanced: int, follow: bool = True) -> int:
        """``ids`` are done; where the slot should move to now (see :meth:`settled`). With
        ``follow`` (records delivered, not dead-lettered), :meth:`durable` is asked about them."""
        held = self._held if follow else None
        for rid in ids:
            at = self._of_id.pop(rid, None)
            if at is not None:
                txn, index = at
                txn.done.add(index)
                if held is not None:
                    held.add(rid)
                    heappush(self._held_order, (txn.commit_lsn, index, rid))
            else:
                self._recovered.add(rid)
        return self.settled(advanced)

    def settled(self, advanced: int) -> int:
        """Forget the leading transactions whose records are all done; where the slot should move
        to, if it is not at or past ``advanced`` yet (else 0). A forgotten transaction is never
        handed out again, even if confirming it failed: the next call retries."""
        while self.kept and self.kept[0].settled:
            txn = self.kept.popleft()
            self._forget(txn)
            self._settled_upto = txn.end_lsn
        return self._settled_upto if self._settled_upto > advanced else 0

    def _forget(self, txn: Transaction) -> None:
        """Free what ``txn`` holds: it settled, or its term ended."""
        self._budget.received -= txn.in_memory
        if txn.spill is not None:
            txn.spill.close()

    def partial(self) -> tuple[int, int]:
        """(commit LSN, done prefix) of the first transaction not all done, if that prefix is not
        empty; else (0, 0)."""
        for txn in self.kept:
            if not txn.settled:
                while txn.prefix in txn.done:
                    txn.prefix += 1
                return (txn.commit_lsn, txn.prefix) if txn.prefix else (0, 0)
        return (0, 0)

    def held_ids(self) -> list[int]:
        """The followed records done and not yet known to be stored done (see :meth:`durable`)."""
        return list(self._held or ())

    def durable(self, ids: Iterable[int], stored: int, partial: tuple[int, int]) -> list[int]:
        """Those of ``ids`` not followed (handed out by an earlier term, or not followed at all), and
        every followed record, of these or of earlier calls, that a new term would not hand out
        again with the position done stored at ``stored`` and ``partial`` (see :meth:`new_term`);
        those are forgotten. A transaction whose commit starts before ``stored`` ends at or before
        it (commit order), and the stored prefix is of the first transaction after it, so what a
        position covers is the start of the heap's order: the cost is per record covered."""
        held = self._held
        if held is None:
            return list(ids)
        out = [rid for rid in ids if rid not in held]
        order, (plsn, pcount) = self._held_order, partial
        while order and (order[0][0] < stored or (order[0][0] == plsn and order[0][1] < pcount)):
            rid = heappop(order)[2]
            held.discard(rid)
            out.append(rid)
        return out

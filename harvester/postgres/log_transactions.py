"""The log source's bookkeeping of received transactions: what the slot sent, in commit order, what
of it is done, and the pass buffer of what a leader id has not been handed yet.

Not thread-safe: :class:`~harvester.postgres.log_store.LogStore` calls it under its state lock (the
mark thread receives and hands out, completion threads settle).

A transaction is kept from its Commit until every record of it is done (acknowledged and deleted,
or dead-lettered); the leading run of settled transactions is then forgotten, and the end LSN of the
last one is where the slot may be confirmed to. A new pass (a new leader id) refills the buffer with
every record of the kept transactions (from memory: the stream goes forward only); records already
done are skipped as they are handed out.
"""

from __future__ import annotations

from collections import deque
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from itertools import repeat
from uuid import UUID

from harvester.core.protocols import StoreError
from harvester.postgres import pgoutput
from harvester.postgres.log_records import Columns


@dataclass(slots=True, eq=False)
class Transaction:
    end_lsn: int
    xid: int
    columns: Columns | None
    inserts: list[bytes]  # its outbox messages, kept until all are done (a new pass re-reads them)
    done: set[int] = field(default_factory=set)  # ids acknowledged (or dead-lettered)
    visible: bool = False  # its rows were found visible to new snapshots (see LogStore._visible)
    commit_time: int = 0  # microseconds since 2000-01-01 UTC

    @property
    def size(self) -> int:
        return len(self.inserts)

    @property
    def settled(self) -> bool:
        return len(self.done) >= len(self.inserts)


Taken = list[tuple[Transaction, bytes]]


class Transactions:
    """The received, unconfirmed transactions of one term, and the current pass over them.

    ``kind`` and ``match`` say which messages are the outbox's: those whose first byte is ``kind``
    and whose bytes from ``at`` are ``match`` (an Insert naming the outbox's oid; a logical message
    with the outbox's prefix)."""

    def __init__(self, kind: bytes, match: bytes, at: int, oid: int = 0) -> None:
        self._kind, self._match, self._at, self._end = kind, match, at, at + len(match)
        self._oid = oid  # the outbox table's oid, whose Relation messages name its columns (0: none)
        self.columns: Columns | None = None  # from the outbox's latest Relation message
        self._pass: UUID | None = None  # the leader id of the current pass
        self._buffer: deque[tuple[Transaction, bytes]] = deque()  # received, not handed out in this pass
        self._received_upto = 0  # end LSN of the last transaction received in this term
        self.kept: deque[Transaction] = deque()  # received, not yet confirmed past
        self._of_id: dict[int, Transaction] = {}
        # Ids done although this term never handed them out (committed checkpoints a new term
        # recovers; completions of the previous term): skipped when the slot sends them.
        self._recovered: set[int] = set()
        self._settled_upto = 0  # the end of the last transaction this term forgot as settled
        self._open: list[bytes] | None = None  # messages of the transaction being received
        self._open_xid = 0  # ... its xid
        self._open_time = 0  # ... and its commit time

    def new_term(self, done_upto: int = 0) -> None:
        """Forget everything received: a new term streams again from the slot's position, skipping
        the transactions that end at or before ``done_upto`` (known done)."""
        self._pass = None
        self._buffer.clear()
        self._received_upto = done_upto
        self.kept.clear()
        self._of_id.clear()
        self._settled_upto = 0
        self._open = None

    def stream_started(self) -> None:
        """A new stream begins at a transaction boundary: a half-received one is dropped."""
        self._open = None

    # ------------------------------------------------------------------ the pass

    def start_pass(self, leader_id: UUID) -> None:
        """A new leader id hands out again every record of the kept transactions."""
        if self._pass != leader_id:
            self._pass = leader_id
            self._buffer = deque((txn, data) for txn in self.kept for data in txn.inserts)

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
        """Up to ``limit`` buffered records of the pass of ``leader_id`` (none under another)."""
        if self._pass != leader_id:
            return []
        return [self._buffer.popleft() for _ in range(min(limit, len(self._buffer)))]

    def put_back(self, leader_id: UUID, taken: Taken) -> None:
        """Return records :meth:`take` gave, to go out first (unless the pass changed meanwhile)."""
        if self._pass == leader_id:
            self._buffer.extendleft(reversed(taken))

    def handed_out(self, txn: Transaction, rid: int) -> bool:
        """Whether record ``rid`` of ``txn`` goes out: not when it is done already (in an earlier
        pass, or recovered); else it is remembered as in flight."""
        if rid in self._recovered:
            self._recovered.discard(rid)
            txn.done.add(rid)
        if rid in txn.done:
            return False
        self._of_id[rid] = txn
        return True

    def unsettled_xids(self) -> list[int]:
        """The xids of the received transactions not all done, and of one half received."""
        xids = [txn.xid for txn in self.kept if not txn.settled]
        if self._open is not None:
            xids.append(self._open_xid)
        return xids

    def pending(self) -> int:
        """Records received and not done yet."""
        return sum(txn.size - len(txn.done) for txn in self.kept)

    def end_of(self, rid: int) -> int | None:
        """The end LSN of the transaction of in-flight record ``rid``."""
        txn = self._of_id.get(rid)
        return None if txn is None else txn.end_lsn

    # ------------------------------------------------------------------ receiving

    def receive(self, messages: Iterable[bytes]) -> None:
        """Keep the outbox's messages of each transaction that commits, skipping transactions this
        term received already (a restarted stream sends them again)."""
        kind, match, at, end = self._kind, self._match, self._at, self._end
        inserts, xid, when = self._open, self._open_xid, self._open_time
        for data in messages:
            if data[:1] == kind:
                if inserts is not None and data[at:end] == match:
                    inserts.append(data)
                continue
            message = pgoutput.parse(data)
            if isinstance(message, pgoutput.Begin):
                inserts = [] if message.final_lsn >= self._received_upto else None
                xid, when = message.xid, message.commit_time
            elif isinstance(message, pgoutput.Relation) and message.oid == self._oid:
                self.columns = Columns(message)
            elif isinstance(message, pgoutput.Commit):
                if inserts is not None and message.end_lsn > self._received_upto:
                    if inserts and self._oid and self.columns is None:
                        raise StoreError("the slot sent inserts of the outbox before its relation")
                    self._received_upto = message.end_lsn
                    txn = Transaction(message.end_lsn, xid, self.columns, inserts, commit_time=when)
                    self.kept.append(txn)
                    self._buffer.extend(zip(repeat(txn), inserts))
                inserts = None
        self._open, self._open_xid, self._open_time = inserts, xid, when

    # ------------------------------------------------------------------ completion

    def completed(self, ids: Sequence[int], advanced: int) -> int:
        """``ids`` are done; where the slot should move to now (see :meth:`settled`)."""
        for rid in ids:
            txn = self._of_id.pop(rid, None)
            if txn is not None:
                txn.done.add(rid)
            else:
                self._recovered.add(rid)
        return self.settled(advanced)

    def settled(self, advanced: int) -> int:
        """Forget the leading transactions whose records are all done; where the slot should move
        to, if it is not at or past ``advanced`` yet (else 0). A forgotten transaction is never
        handed out again, even if confirming it failed: the next call retries."""
        while self.kept and self.kept[0].settled:
            self._settled_upto = self.kept.popleft().end_lsn
        return self._settled_upto if self._settled_upto > advanced else 0

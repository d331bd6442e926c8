"""Transactions the walsender streams while they are still in progress (pgoutput protocol version 2,
``streaming 'on'``), put back together as whole ones at their commit.

Once a transaction's decoded changes outgrow the session's ``logical_decoding_work_mem`` (1 MB, store.py), the
walsender sends them as they are decoded, in blocks (Stream Start … Stream Stop) between other
transactions, instead of spilling them to disk and sending them all after the commit. A burst
written in one large transaction then reaches the harvester while it is being written, and the
drain starts at its commit with every record at hand: the walsender's work of reading the
transaction back, encoding and sending it, and the harvester's of receiving it, are done by then.

A streamed change carries its (sub)transaction's xid after its kind; :class:`StreamedTransactions`
keeps each transaction's changes without it, so that what it gives at a Stream Commit (a Begin, the
changes, a Commit) is what the walsender sends for a transaction it did not stream. A Stream Abort
drops the transaction, or the subtransaction and whatever came after its first change (those are
its own or its subtransactions': PostgreSQL's own apply worker truncates its spool file so).

The outbox's rows of an in-progress transaction are held until its end, as the rows of a received
transaction are until they are done: in memory within the store's
:class:`~harvester.postgres.log.spill.Budget`, and a large transaction's changes past it, as they came,
in a :class:`~harvester.postgres.log.spill.Spill`. A *decoder* may keep a change in memory in another
form: each in-progress transaction gets one (:data:`Decoder`), which sees its changes in order as
they come (until they spill) and returns what to keep instead of a change, or
None to keep the change; a change it fails on is kept as it came (whoever reads it later meets the
error there). The log source decodes its inserts so, while the transaction is still being written,
rather than after its commit, when the drain waits for them (docs/benchmarks.md, "Decoding a
streamed transaction as it comes"). A decoder with a native twin (:class:`ChangeDecoder`'s ``fast``:
the C decoder of the usual layout) takes a block's run of inserts straight from the stream's copy
data (:meth:`StreamedTransactions.take_inserts`), with no Python object per message but the record.
Reference: PostgreSQL's "Logical Replication Message Formats" (Stream Start, Stream Stop, Stream
Commit, Stream Abort).
"""

from __future__ import annotations

import struct
from collections.abc import Callable
from typing import Final, Protocol

from harvester.postgres.log import pgoutput
from harvester.postgres.log.spill import DECODED_COST, MESSAGE_COST, Budget, Spill

# The kinds that open, close, commit or abort a stream: 'S', 'E', 'c', 'A'.
STREAM_KINDS = frozenset(b"SEcA")
_START = struct.Struct("!I")  # xid (then a first-segment flag)
_COMMIT = struct.Struct("!IbQQq")  # xid, flags, commit LSN, end LSN, commit time
_ABORT = struct.Struct("!II")  # xid, subtransaction's xid
# Kinds of the changes a stream carries with their xid: Relation, Type, Insert, Update, Delete,
# Truncate, logical Message (an Origin carries none).
_WITH_XID = frozenset(b"RYIUDTM")

# What a stream gives: a message, or what a decoder kept instead of a change.
Received = bytes | object
# Given between a committed transaction's changes kept in memory and those that were spilled: its
# receiver spills from there too (transactions.py), so that what is decoded stays in memory.
SPILLED: Final = b"\xffspilled"


class FastInserts(Protocol):
    """A native decoder's :meth:`StreamedTransactions.take` of one table's inserts, straight from
    the stream's copy data (``_usual_insert.c``'s ``take_streamed``)."""

    def take_streamed(
        self,
        raw: list[bytes | memoryview],
        start: int,
        head: int,
        xid: bytes,
        oid: bytes,
        changes: list[object],
        room: int,
        cost: int,
        /,
    ) -> tuple[int, int]: ...


class ChangeDecoder(Protocol):
    """The decoder of one in-progress transaction: given each of its changes (without its xid),
    what to keep instead, or None to keep the change itself."""

    # The native take of its table's inserts and the table's oid (4 bytes), while the transaction's
    # latest Relation of the table is one that decoder reads; else None.
    fast: tuple[FastInserts, bytes] | None

    def __call__(self, change: bytes, /) -> object | None: ...


# Makes the decoder of one in-progress transaction.
Decoder = Callable[[], ChangeDecoder]


class _Streamed:
    """One in-progress transaction's changes so far (in memory, then past the limit in a spill), and
    where each subtransaction's first is."""

    __slots__ = ("changes", "decode", "firsts", "in_memory", "last", "spill")

    def __init__(self, decode: ChangeDecoder | None) -> None:
        self.changes: list[Received] = []
        self.decode = decode
        self.firsts: dict[bytes, int] = {}  # by the xid's 4 bytes
        self.last = b""  # the xid of the latest change
        self.in_memory = 0  # what its changes in memory take (estimated, spill.py)
        self.spill: Spill | None = None  # its changes past the budget, from the first one that outgrew it

    @property
    def size(self) -> int:
        return len(self.changes) + (len(self.spill) if self.spill is not None else 0)

    def truncate(self, length: int) -> int:
        """Forget the changes from position ``length`` on; what that frees in memory (estimated)."""
        kept, before = len(self.changes), self.in_memory
        if length < kept:
            self.in_memory = self.in_memory * length // kept  # as estimated: about what they took
            del self.changes[length:]
            if self.spill is not None:
                self.spill.close()
                self.spill = None
        elif self.spill is not None:
            self.spill.truncate(length - kept)
        return before - self.in_memory

    def close(self) -> None:
        if self.spill is not None:
            self.spill.close()


class StreamedTransactions:
    """The streamed transactions of one replication stream (a new stream sends them again)."""

    def __init__(self, decoder: Decoder | None = None, budget: Budget | None = None) -> None:
        """``budget``: what the transactions' changes may take in memory (estimated: a change's size
        and :data:`~harvester.postgres.log.spill.MESSAGE_COST`, or :data:`~harvester.postgres.log.spill.DECODED_COST`
        when decoded), counted in its ``streamed``; once over it, a transaction past its floor spills
        its next changes as they came (not decoded), given after :data:`SPILLED`. At its commit, a
        transaction's count is ``handed`` to its receiver, whose memory its changes go to."""
        self._decoder = decoder
        self._budget = budget or Budget()
        # How much the current transaction may hold before it spills: the budget's room for it as of
        # its block's start (the walsender sends nothing else inside a block, so what the others hold
        # can hardly grow meanwhile), and at least the floor. Computed once: a change only compares.
        self._spill_at = 0
        self._open: dict[int, _Streamed] = {}
        self._current: _Streamed | None = None  # inside a Stream Start … Stream Stop block
        # A committed transaction's messages not given out yet: its Begin, its changes and its
        # Commit, the spilled changes read back as they are given.
        self._ready: list[Received] = []
        self._spilled: Spill | None = None
        self._commit = b""
        self._given = 0  # how many of _ready, then of _spilled, were

    @property
    def active(self) -> bool:
        """Inside a stream block: every message goes to :meth:`take`."""
        return self._current is not None

    @property
    def ready(self) -> bool:
        """A committed transaction has messages not given out yet (:meth:`give`)."""
        return bool(self._commit)

    @property
    def in_progress(self) -> int:
        """Transactions streamed in part and not committed or aborted yet."""
        return len(self._open)

    def take(self, message: bytes) -> None:
        """A message of a stream block, or one opening, closing, committing or aborting a stream."""
        current, kind = self._current, message[0]
        if current is not None and kind not in STREAM_KINDS:
            decode = None
            if kind in _WITH_XID:
                xid = message[1:5]
                if xid != current.last:
                    current.firsts.setdefault(xid, current.size)
                    current.last = xid
                message, decode = message[:1] + message[5:], current.decode
            if current.spill is not None:
                current.spill.append(message)
                return
            kept = None
            if decode is not None:
                try:
                    kept = decode(message)
                except Exception:  # kept as it came: decoded again where it is read, the error met there
                    kept = None
            if kept is None:
                current.changes.append(message)
                cost = len(message) + MESSAGE_COST
            else:
                current.changes.append(kept)
                cost = len(message) + DECODED_COST
            current.in_memory += cost
            self._budget.streamed += cost
            if current.in_memory > self._spill_at:
                current.spill = self._budget.spill()
        elif kind == 0x53:  # 'S'
            (xid,) = _START.unpack_from(message, 1)
            current = self._open.get(xid)
            if current is None:
                current = self._open[xid] = _Streamed(None if self._decoder is None else self._decoder())
            self._current = current
            self._spill_at = self._budget.room(current.in_memory)
        elif kind == 0x45:  # 'E'
            self._current = None
        elif kind == 0x63:  # 'c'
            xid, flags, commit_lsn, end_lsn, when = _COMMIT.unpack_from(message, 1)
            streamed = self._open.pop(xid, None)
            self._ready = [pgoutput.begin_message(commit_lsn, when, xid)]
            if streamed is not None:
                self._budget.streamed -= streamed.in_memory
                self._budget.handed += streamed.in_memory
                self._ready += streamed.changes
                if streamed.spill is not None:
                    self._ready.append(SPILLED)
                    self._spilled = streamed.spill
            self._commit = pgoutput.commit_message(flags, commit_lsn, end_lsn, when)
            self._given = 0
        elif kind == 0x41:  # 'A'
            xid, sub = _ABORT.unpack_from(message, 1)
            self._abort(xid, sub)

    def take_inserts(self, raw: list[bytes | memoryview], start: int, head: int) -> int:
        """Take, from ``raw[start]`` on (copy data whose message starts at ``head``), what the
        current block's decoder takes natively (:class:`ChangeDecoder`'s ``fast``): inserts of its
        table by the subtransaction of the latest change, as :meth:`take` would, without a Python
        object per message but the record. The index of the first not taken (``start`` when none)."""
        current = self._current
        if current is None or current.spill is not None or current.decode is None or not current.last:
            return start
        fast = current.decode.fast
        if fast is None:
            return start
        native, oid = fast
        room = self._spill_at - current.in_memory
        end, cost = native.take_streamed(raw, start, head, current.last, oid, current.changes, room, DECODED_COST)
        if end > start:
            current.in_memory += cost
            self._budget.streamed += cost
            if current.in_memory > self._spill_at:
                current.spill = self._budget.spill()
        return end

    def _abort(self, xid: int, sub: int) -> None:
        if sub == xid:
            streamed = self._open.pop(xid, None)
            if streamed is not None:
                self._budget.streamed -= streamed.in_memory
                streamed.close()
            return
        streamed = self._open.get(xid)
        first = None if streamed is None else streamed.firsts.get(_START.pack(sub))
        if streamed is None or first is None:
            return  # none of its changes came
        self._budget.streamed -= streamed.truncate(first)
        streamed.firsts = {x: at for x, at in streamed.firsts.items() if at < first}
        streamed.last = b""

    def give(self, out: list[Received], limit: int) -> None:
        """Append up to ``limit`` messages of the committed transaction to ``out``."""
        ready, spilled, given = self._ready, self._spilled, self._given
        head = len(ready)
        total = head + (len(spilled) if spilled is not None else 0)  # then its Commit
        end = min(total + 1, given + limit)
        if given < head:
            out += ready[given : min(end, head)]
        if spilled is not None and given < total and end > head:
            out += spilled.read(max(given, head) - head, min(end, total) - head)
        if end <= total:
            self._given = end
            return
        out.append(self._commit)
        self._ready, self._spilled, self._commit, self._given = [], None, b"", 0
        if spilled is not None:
            spilled.close()

    def close(self) -> None:
        """Remove the spills of the transactions held, and their count from the budget (a committed
        one's too, unless its receiver took it)."""
        for streamed in self._open.values():
            self._budget.streamed -= streamed.in_memory
            streamed.close()
        self._open.clear()
        self._budget.handed = 0
        if self._spilled is not None:
            self._spilled.close()
            self._spilled = None

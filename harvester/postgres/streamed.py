"""Transactions the walsender streams while they are still in progress (pgoutput protocol version 2,
``streaming 'on'``), put back together as whole ones at their commit.

Once a transaction's decoded changes outgrow the server's ``logical_decoding_work_mem``, the
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

The outbox's rows of an in-progress transaction are held in memory until its end, as the rows of a
received transaction are until they are done. A *decoder* may keep a change in another form: each
in-progress transaction gets one (:data:`Decoder`), which sees its changes in order as they come and
returns what to keep instead of a change, or None to keep the change; a change it fails on is kept
as it came (whoever reads it later meets the error there). The log source decodes its
inserts so, while the transaction is still being written, rather than after its commit, when the
drain waits for them (docs/log-source.md, "Decoding a streamed transaction as it comes").
Reference: PostgreSQL's "Logical Replication Message Formats" (Stream Start, Stream Stop, Stream
Commit, Stream Abort).
"""

from __future__ import annotations

import struct
from collections.abc import Callable

from harvester.postgres import pgoutput

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
# Makes the decoder of one in-progress transaction: given each of its changes (without its xid),
# what to keep instead, or None to keep the change itself.
Decoder = Callable[[], Callable[[bytes], object | None]]


class _Streamed:
    """One in-progress transaction's changes so far, and where each subtransaction's first is."""

    __slots__ = ("changes", "decode", "firsts", "last")

    def __init__(self, decode: Callable[[bytes], object | None] | None) -> None:
        self.changes: list[Received] = []
        self.decode = decode
        self.firsts: dict[bytes, int] = {}  # by the xid's 4 bytes
        self.last = b""  # the xid of the latest change


class StreamedTransactions:
    """The streamed transactions of one replication stream (a new stream sends them again)."""

    def __init__(self, decoder: Decoder | None = None) -> None:
        self._decoder = decoder
        self._open: dict[int, _Streamed] = {}
        self._current: _Streamed | None = None  # inside a Stream Start … Stream Stop block
        self._ready: list[Received] = []  # a committed transaction's messages not given out yet
        self._given = 0  # how many of _ready were

    @property
    def active(self) -> bool:
        """Inside a stream block: every message goes to :meth:`take`."""
        return self._current is not None

    @property
    def ready(self) -> bool:
        """A committed transaction has messages not given out yet (:meth:`give`)."""
        return self._given < len(self._ready)

    @property
    def in_progress(self) -> int:
        """Transactions streamed in part and not committed or aborted yet."""
        return len(self._open)

    def take(self, message: bytes) -> None:
        """A message of a stream block, or one opening, closing, committing or aborting a stream."""
        current, kind = self._current, message[0]
        if current is not None and kind in _WITH_XID:
            xid = message[1:5]
            if xid != current.last:
                current.firsts.setdefault(xid, len(current.changes))
                current.last = xid
            change = message[:1] + message[5:]
            kept = None
            if current.decode is not None:
                try:
                    kept = current.decode(change)
                except Exception:  # kept as it came: decoded again where it is read, the error met there
                    kept = None
            current.changes.append(change if kept is None else kept)
        elif current is not None and kind not in STREAM_KINDS:
            current.changes.append(message)
        elif kind == 0x53:  # 'S'
            (xid,) = _START.unpack_from(message, 1)
            current = self._open.get(xid)
            if current is None:
                current = self._open[xid] = _Streamed(None if self._decoder is None else self._decoder())
            self._current = current
        elif kind == 0x45:  # 'E'
            self._current = None
        elif kind == 0x63:  # 'c'
            xid, flags, commit_lsn, end_lsn, when = _COMMIT.unpack_from(message, 1)
            streamed = self._open.pop(xid, None)
            changes = streamed.changes if streamed is not None else []
            self._ready = [
                pgoutput.begin_message(commit_lsn, when, xid),
                *changes,
                pgoutput.commit_message(flags, commit_lsn, end_lsn, when),
            ]
            self._given = 0
        elif kind == 0x41:  # 'A'
            xid, sub = _ABORT.unpack_from(message, 1)
            self._abort(xid, sub)

    def _abort(self, xid: int, sub: int) -> None:
        if sub == xid:
            self._open.pop(xid, None)
            return
        streamed = self._open.get(xid)
        first = None if streamed is None else streamed.firsts.get(_START.pack(sub))
        if streamed is None or first is None:
            return  # none of its changes came
        del streamed.changes[first:]
        streamed.firsts = {x: at for x, at in streamed.firsts.items() if at < first}
        streamed.last = b""

    def give(self, out: list[Received], limit: int) -> None:
        """Append up to ``limit`` messages of the committed transaction to ``out``."""
        end = min(len(self._ready), self._given + limit)
        out += self._ready[self._given : end]
        self._given = end
        if end == len(self._ready):
            self._ready, self._given = [], 0

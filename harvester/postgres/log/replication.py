"""A logical replication stream: PostgreSQL's streaming replication protocol, spoken over psycopg's
libpq layer (``psycopg.pq``), which can hold a connection in COPY BOTH mode.

``START_REPLICATION SLOT ... LOGICAL`` makes the server's walsender decode the log once, forward,
from the slot's position, and send each change of the committed transactions as an XLogData
message ('w'), in commit order; a large transaction's changes come while it is in progress, and
:mod:`harvester.postgres.log.streamed` holds them until its commit. Now and then it sends a primary
keepalive ('k') with the position its decoding reached; it asks for an answer when it has heard
nothing from us for half its ``wal_sender_timeout``. The client's standby status update ('r')
reports how far it has consumed: the flush position it names becomes the slot's
``confirmed_flush_lsn``, where the next stream starts (PostgreSQL's "Streaming Replication
Protocol" and "Logical Streaming Replication Protocol").

The stream is not thread-safe: its owner serializes reads and confirmations.
"""

from __future__ import annotations

import os
import select
import socket
import struct
import time
from typing import Final

import psycopg
from psycopg import pq

from harvester.core.protocols import StoreError
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import STREAM_KINDS, Decoder, Received, StreamedTransactions

_XLOG_HEAD: Final = 25  # 'w', start LSN, end LSN, send time
_KEEPALIVE = struct.Struct("!QQB")  # end of WAL (for a logical walsender: how far it decoded), time, reply?
_STATUS = struct.Struct("!cQQQQB")  # 'r', written, flushed, applied, client time, reply?
_EPOCH_2000 = 946_684_800  # the protocol's clock starts at 2000-01-01 (in microseconds)
SLOT_IN_USE: Final = "55006"  # the slot is active for another walsender
# The stream socket's receive buffer (the kernel's autotuning grows it to megabytes otherwise). The
# walsender writes each change as it decodes it, in a send() of its own while the socket has room,
# and what it could not send in one later; a buffer that a reader pausing a few milliseconds
# (reading.py) fills makes it send a large transaction in fewer, larger writes: 1.5 s less of its
# CPU per 1,000,000 records (docs/benchmarks.md, "Taking a streamed transaction in bulk").
_RECEIVE_BUFFER = 256 * 1024


class StreamError(StoreError):
    """The stream could not start or broke; ``sqlstate`` when the server said why."""

    def __init__(self, message: str, sqlstate: str | None = None) -> None:
        super().__init__(message)
        self.sqlstate = sqlstate


def _literal(text: str) -> str:
    return "'" + text.replace("'", "''") + "'"


def _ident(text: str) -> str:
    return '"' + text.replace('"', '""') + '"'


class LogicalStream:
    """The changes of one logical slot, read through a ``pgoutput`` publication."""

    def __init__(
        self,
        conninfo: str,
        slot: str,
        publication: str,
        flushed: int,
        *,
        messages: bool = False,
        decoder: Decoder | None = None,
        budget: Budget | None = None,
    ) -> None:
        """Connect as a replication client and stream from the slot's confirmed position, which is
        ``flushed`` (answers to keepalives report it until :meth:`confirm` moves it); with
        ``messages``, the transactions' logical decoding messages too; with ``decoder``, the changes
        of transactions streamed in progress are kept as it says, within ``budget`` and past it
        spilled (streamed.py, spill.py). Needs PostgreSQL 14+."""
        self.server_end = 0  # how far the walsender's decoding reached, per its latest keepalive
        self._flushed = flushed  # the flush position reported last
        self.drained = True  # the last read took everything that had arrived
        self._reported = time.monotonic()  # when the last status update went out
        self.streamed = StreamedTransactions(decoder, budget)
        # Copy data received and not yet taken, from _at on (read).
        self._raw: list[bytes | memoryview] = []
        self._at = 0
        # psycopg's connect, not PGconn.connect: that one holds the GIL until the server answers,
        # which froze every thread of the process for up to connect_timeout per host.
        try:
            self._connection = psycopg.Connection.connect(
                psycopg.conninfo.make_conninfo(conninfo, replication="database"), autocommit=True
            )
        except psycopg.OperationalError as exc:
            lines = str(exc).strip().splitlines()
            raise StreamError(f"cannot connect for replication: {lines[0] if lines else 'connection failed'}") from exc
        self._conn = self._connection.pgconn
        try:
            # 0/0: the server starts at the slot's confirmed_flush_lsn (a lower start is ignored).
            # Values in their binary forms (PostgreSQL 14+): cheaper to read than text (records.py).
            # Large transactions streamed while in progress (protocol 2, PostgreSQL 14+; streamed.py).
            command = (
                f"START_REPLICATION SLOT {_ident(slot)} LOGICAL 0/0"
                f" (proto_version '2', streaming 'on', publication_names {_literal(_ident(publication))}, binary 'true'"
                + (", messages 'true')" if messages else ")")
            )
            result = self._conn.exec_(command.encode())
            if result.status != pq.ExecStatus.COPY_BOTH:
                sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
                message = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
                raise StreamError(
                    f"starting replication from slot {slot} failed: "
                    + (message.decode(errors="replace") if message else self._error()),
                    sqlstate.decode() if sqlstate else None,
                )
            self._conn.nonblocking = 1
            with socket.socket(fileno=os.dup(self._conn.socket)) as shared:  # the same socket: closing frees the copy
                shared.setsockopt(socket.SOL_SOCKET, socket.SO_RCVBUF, _RECEIVE_BUFFER)
        except BaseException:
            self._connection.close()
            raise

    def _error(self) -> str:
        lines = self._conn.get_error_message().strip().splitlines()
        return lines[0] if lines else "connection lost"

    def read(self, limit: int) -> list[Received]:
        """Up to ``limit`` pgoutput messages that have arrived (or what the decoder kept of a
        streamed transaction's changes), without waiting, after taking in fewer than ``limit``
        messages of streamed transactions; keepalives are answered when the server asks.

        The copy data comes from libpq a batch at a time (:meth:`_receive`); a streamed transaction's
        inserts that its decoder takes natively are taken from the batch at once, each other message
        one by one. What a committed streamed transaction's messages, given first, leave of the
        batch waits for the next read."""
        out: list[Received] = []
        streamed, raw = self.streamed, self._raw
        self.drained = False
        taken = 0
        at = self._at
        try:
            ended = False
            while len(out) + taken < limit:
                if streamed.ready:  # a committed streamed transaction's messages go first, in order
                    streamed.give(out, limit - len(out) - taken)
                    continue
                if at == len(raw):
                    if ended:
                        self.drained = True
                        break
                    raw.clear()
                    at = 0
                    ended = self._receive(raw, limit - len(out) - taken)
                    continue
                data = raw[at]
                kind = data[0]
                if kind == 0x77 and streamed.active and data[_XLOG_HEAD] == 0x49:  # an Insert in a stream block
                    upto = streamed.take_inserts(raw, at, _XLOG_HEAD)
                    if upto > at:
                        taken += upto - at
                        at = upto
                        continue
                at += 1
                if kind == 0x77:  # 'w'
                    message = bytes(data[_XLOG_HEAD:])
                    if streamed.active or message[0] in STREAM_KINDS:
                        streamed.take(message)
                        taken += 1
                    else:
                        out.append(message)
                elif kind == 0x6B:  # 'k'
                    end, _, reply = _KEEPALIVE.unpack_from(data, 1)
                    self.server_end = max(self.server_end, end)
                    if reply:
                        self._report()
        finally:
            self._at = at
        return out

    def _receive(self, raw: list[bytes | memoryview], limit: int) -> bool:
        """Up to ``limit`` copy data messages that have arrived, into ``raw``; whether that was all:
        libpq reads the socket again while a read brought more (each read takes what its buffer holds)."""
        conn = self._conn
        consumed = False
        try:
            while len(raw) < limit:
                size, data = conn.get_copy_data(1)
                if size > 0:
                    raw.append(data)
                    consumed = False
                elif size == 0:
                    if consumed:
                        return True
                    conn.consume_input()
                    consumed = True
                else:
                    why, sqlstate = self._result_error()
                    raise StreamError(f"the replication stream ended: {why}", sqlstate)
        except psycopg.OperationalError as exc:
            raise StreamError(f"the replication stream broke: {str(exc).strip()}") from exc
        return False

    def _result_error(self) -> tuple[str, str | None]:
        """Why the server ended the stream, and its SQLSTATE when it said."""
        result = self._conn.get_result()
        if result is None:
            return "no reason given", None
        message = result.error_field(pq.DiagnosticField.MESSAGE_PRIMARY)
        sqlstate = result.error_field(pq.DiagnosticField.SQLSTATE)
        return (
            message.decode(errors="replace") if message else "no reason given",
            sqlstate.decode() if sqlstate else None,
        )

    def wait(self, timeout: float) -> bool:
        """Block until data arrives (True) or ``timeout`` passes (False)."""
        if not self.drained:
            return True  # libpq holds messages the last read left
        try:
            ready, _, _ = select.select([self._conn.socket], [], [], timeout)
        except (OSError, psycopg.OperationalError):
            return True  # the next read says what broke
        return bool(ready)

    def keep_alive(self, every: float) -> None:
        """Tell the server the stream is still wanted if nothing was sent for ``every`` seconds: it
        ends a stream that stays silent for its ``wal_sender_timeout``."""
        if time.monotonic() - self._reported > every:
            self._report()

    def confirm(self, lsn: int) -> None:
        """Report everything before ``lsn`` consumed, which moves the slot (never less than reported
        before: a lower flush position would move it back on older servers)."""
        self._flushed = max(self._flushed, lsn)
        self._send(self._flushed, self._flushed)

    def _report(self) -> None:
        """Say how far the stream was received, with no flush position (the slot stays where it
        is). A walsender that shuts down waits until its client reports all it sent: this lets a
        fast shutdown of the server finish while records are still in flight."""
        self._send(max(self.server_end, self._flushed), 0)

    def _send(self, written: int, flushed: int) -> None:
        now = int((time.time() - _EPOCH_2000) * 1_000_000)
        message = _STATUS.pack(b"r", written, flushed, flushed, now, 0)
        self._reported = time.monotonic()
        try:
            self._conn.put_copy_data(message)
            while self._conn.flush():
                select.select([], [self._conn.socket], [], 1.0)
        except psycopg.OperationalError as exc:
            raise StreamError(f"writing to the replication stream failed: {str(exc).strip()}") from exc

    def close(self) -> None:
        self._connection.close()
        self.streamed.close()

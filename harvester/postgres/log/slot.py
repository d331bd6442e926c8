"""The log source's hold on its replication slot: one stream at a time, started from the slot's
position once the slot's previous reader has let go (the store's take-over, a fenced statement),
started again after it broke, kept alive while the leader reads nothing, let go when the store's
session breaks, and told how far everything is consumed. Its lock serialises the mark thread's
reads with the confirmations that follow the completions' statements."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable

from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.replication import SLOT_IN_USE, LogicalStream, StreamError
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import Decoder, Received

# Starting the stream while the slot's previous reader is still exiting: tries, and the pause between.
_START_TRIES = 50
_START_PAUSE = 0.1


class SlotStream:
    """The stream of one slot, as the log source reads and confirms it."""

    def __init__(
        self,
        setup: LogSetup,
        take_over: Callable[[], int],
        on_start: Callable[[], None],
        decoder: Decoder | None = None,
        budget: Budget | None = None,
    ) -> None:
        """``take_over`` terminates the slot's other reader under the fence and returns the slot's
        confirmed position; ``on_start`` runs once a new stream started (a restarted stream sends
        again what the previous one sent past that position); ``decoder`` and ``budget`` are each
        stream's (see :class:`~harvester.postgres.log.replication.LogicalStream`)."""
        self.conninfo = ""  # the store's, set before the first start
        self._setup = setup
        self._take_over = take_over
        self._on_start = on_start
        self._decoder = decoder
        self._budget = budget
        self._lock = threading.Lock()
        self._stream: LogicalStream | None = None
        # The position confirmed to the server, or to confirm when the next stream starts.
        self.advanced = 0

    @property
    def streaming(self) -> bool:
        return self._stream is not None

    @property
    def server_end(self) -> int:
        """How far the walsender's decoding reached, per its latest keepalive (0 without a stream)."""
        stream = self._stream
        return 0 if stream is None else stream.server_end

    @property
    def in_progress(self) -> bool:
        """The stream has sent part of a transaction that has not ended yet (streamed.py)."""
        stream = self._stream
        return stream is not None and stream.streamed.in_progress > 0

    def take_over(self) -> None:
        """A new term: let this process's stream go, and the slot's other reader too."""
        with self._lock:
            self._close()
            self._take_over()

    def read(self, limit: int) -> tuple[list[Received], bool]:
        """Up to ``limit`` messages that have arrived, starting a stream when there is none, and
        whether they were all that had arrived. A stream that breaks is closed (the next read
        starts another) and its :class:`StreamError` raised."""
        with self._lock:
            if self._stream is None:
                self._stream = self._start()
            try:
                return self._stream.read(limit), self._stream.drained
            except StreamError:
                self._close()
                raise

    def read_open(self, limit: int) -> list[Received]:
        """As :meth:`read`, from a stream already open only; nothing when it broke."""
        with self._lock:
            if self._stream is None:
                return []
            try:
                return self._stream.read(limit)
            except StreamError:
                self._close()
                return []

    def wait(self, timeout: float) -> bool:
        """Block until data arrives (True) or ``timeout`` passes (False); True without a stream
        (the next read starts one)."""
        stream = self._stream
        return True if stream is None else stream.wait(timeout)

    def keep_alive(self, every: float) -> None:
        """Tell the server the stream is still wanted, at least ``every`` seconds."""
        with self._lock:
            if self._stream is not None:
                try:
                    self._stream.keep_alive(every)
                except StreamError:
                    self._close()  # the next read starts another

    def confirm(self, lsn: int) -> None:
        """Report everything before ``lsn`` consumed; only right after a fenced statement found the
        epoch current. Without a stream (or when it broke), the next one reports it when it starts."""
        with self._lock:
            self.advanced = max(self.advanced, lsn)
            if self._stream is not None:
                try:
                    self._stream.confirm(self.advanced)
                except StreamError:
                    self._close()

    def confirm_on_start(self, lsn: int) -> None:
        """Have the next stream report everything before ``lsn`` consumed when it starts."""
        with self._lock:
            self.advanced = max(self.advanced, lsn)

    def close(self) -> None:
        with self._lock:
            self._close()

    def let_go(self) -> None:
        """Close the stream, from a thread whose statement found the server gone, unless a read
        holds it (a read answers the server itself). A server that shuts down waits until this
        stream answers its last keepalive, which a leader backing off from failed statements does not
        read: a fast shutdown took ``wal_sender_timeout`` then."""
        if self._lock.acquire(blocking=False):
            try:
                self._close()
            finally:
                self._lock.release()

    def _close(self) -> None:
        if self._stream is not None:
            self._stream.close()
            self._stream = None

    def _start(self) -> LogicalStream:
        """A stream from the slot's position, once its previous reader has let go (caller holds
        the lock)."""
        for tries in range(_START_TRIES, 0, -1):
            confirmed = self._take_over()
            try:
                stream = LogicalStream(
                    self.conninfo,
                    self._setup.slot,
                    self._setup.publication,
                    confirmed,
                    messages=self._setup.prefix is not None,
                    decoder=self._decoder,
                    budget=self._budget,
                )
            except StreamError as exc:
                if exc.sqlstate != SLOT_IN_USE or tries == 1:
                    raise
                time.sleep(_START_PAUSE)
                continue
            self._on_start()
            self.advanced = max(self.advanced, confirmed)
            if self.advanced > confirmed:  # done before the previous stream could confirm it
                stream.confirm(self.advanced)
            return stream
        raise AssertionError("unreachable")

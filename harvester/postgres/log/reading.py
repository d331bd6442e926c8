"""How a log store's mark thread reads its slot's stream: when and how much to read (at once,
ahead while records go out, waiting for the rest of a transaction that is coming), and when an idle
leader confirms how far the server decoded."""

from __future__ import annotations

import time

from harvester.core.records import MarkedRecord
from harvester.postgres.connections import Connections
from harvester.postgres.log.parts import Finish, Ledger
from harvester.postgres.log.recovery import SlotLostError, slot_lost
from harvester.postgres.log.replication import StreamError
from harvester.postgres.log.visibility import INVISIBLE_RECHECK

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
# While a transaction is coming and no record waits to go out, a read that found the stream
# drained waits this long after more arrived: the walsender sends each change as it decodes it, and
# taking them in a few at a time cost the relay more per message than decoding them, and the
# walsender a write per message (replication.py's _RECEIVE_BUFFER; docs/benchmarks.md, "Taking a
# streamed transaction in bulk").
_GATHER_SECONDS = 0.005
# A status update at least this often, whatever else happens, within the walsender's timeout, which
# the store sets (store.py).
_STATUS_SECONDS = 10.0


class Reader:
    """The reads of one log store's mark thread."""

    def __init__(self, ledger: Ledger, finish: Finish, slot_name: str, db: Connections) -> None:
        self._ledger, self._finish, self._slot_name, self._db = ledger, finish, slot_name, db
        self._next_idle_confirm = 0.0  # monotonic time
        # Records went out since the last idle confirmation: the next one is due as soon as all are
        # done (what their completions wrote, deletes or the stored position, lies past them).
        self._handed_since_idle = False
        self._next_read = 0.0  # ... and the next read while records wait in the buffer

    def read(self, want: int) -> None:
        """Receive what the stream has, until ``want`` records wait, or a transaction came whole,
        or nothing more has arrived. While a transaction is half received (or streamed in part,
        before its commit), wait for more of it here: the walsender sends a large one at its own
        pace, a few messages per read, and ending the mark at each read made one mark per few
        records (75,000 while a 300,000-record transaction came in). What came within
        :data:`_TRICKLE_SECONDS` goes out then, whatever its number, and a read that receives
        nothing to hand out (nothing at all, or a transaction streamed in progress that keeps
        coming) ends after :data:`_READ_SECONDS`. While nothing waits to go out, it lets a coming
        transaction's messages gather for :data:`_GATHER_SECONDS` before it takes them in."""
        ledger, slot = self._ledger, self._ledger.slot
        restarted = False
        started = time.monotonic()
        while True:
            self._next_read = time.monotonic() + _READ_SECONDS
            try:
                messages, drained = slot.read(_READ_MESSAGES)
            except StreamError as exc:
                lost = slot_lost(self._slot_name, exc, self._db)
                if lost is not None:  # dropped or invalidated since the take-over looked
                    raise SlotLostError(lost) from exc
                # Broken (the server's wal_sender_timeout while nobody read, a restart): once more
                # from the slot's position, skipping what was received; then the engine's retry.
                if restarted:
                    raise
                restarted = True
                continue
            ledger.receive(messages)
            with ledger.state:
                waiting, receiving = ledger.txns.waiting, ledger.txns.receiving
            receiving = receiving or slot.in_progress
            now = time.monotonic()
            if waiting and (not receiving or waiting >= want or now - started > _TRICKLE_SECONDS):
                return
            if now - started > _READ_SECONDS:
                return
            if drained:
                left = started + (_TRICKLE_SECONDS if waiting else _READ_SECONDS) - now
                if not receiving or left <= 0 or not slot.wait(left):
                    return
                if not waiting:
                    time.sleep(min(_GATHER_SECONDS, left))

    def wait(self, timeout: float) -> bool:
        """Until the stream has something to read. While a received transaction waits to become
        visible (:mod:`.visibility`), at most ``INVISIBLE_RECHECK``: the stream may stay quiet, and
        the engine's idle back-off would hold its records back for as long."""
        ledger = self._ledger
        with ledger.state:
            waiting = ledger.txns.waiting
        if waiting:
            ledger.slot.wait(min(timeout, INVISIBLE_RECHECK))
            return True
        return ledger.slot.wait(timeout)

    def ahead(self, waiting: int) -> None:
        """``waiting`` records wait in the buffer: read ahead while records go out (and the
        server's keepalives answered), then keep the stream wanted, however long the buffer takes
        to drain."""
        slot = self._ledger.slot
        if waiting and (waiting < _READ_AHEAD or time.monotonic() > self._next_read):
            self._next_read = time.monotonic() + _READ_SECONDS
            self._ledger.receive(slot.read_open(_READ_MESSAGES))
        slot.keep_alive(_STATUS_SECONDS)

    def handed_out(self, out: list[MarkedRecord]) -> None:
        """After a mark handed ``out`` out: confirm what settled if nothing went out, and an idle
        leader's position when due."""
        ledger = self._ledger
        with ledger.state:
            settled = ledger.txns.settled(ledger.slot.advanced)
            idle = (
                not out and ledger.txns.idle and (self._handed_since_idle or time.monotonic() > self._next_idle_confirm)
            )
        if out:
            self._handed_since_idle = True
        if settled and not out:
            self._finish.advance_to(settled)
        if idle:
            self._confirm_idle()

    def _confirm_idle(self) -> None:
        """Confirm how far the server decoded, all received being done: the slot moves past what
        other tables wrote meanwhile, which an idle outbox would otherwise keep in the log. After
        records went out, tried on each idle mark until it moves the slot (the server's keepalives
        tell how far it decoded), then every :data:`_IDLE_CONFIRM_SECONDS`."""
        end = self._ledger.slot.server_end
        if end > self._ledger.slot.advanced:
            self._finish.advance_to(end)
        elif self._handed_since_idle:
            return
        self._next_idle_confirm = time.monotonic() + _IDLE_CONFIRM_SECONDS
        self._handed_since_idle = False

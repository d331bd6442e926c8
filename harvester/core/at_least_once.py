"""At-least-once delivery: records go out one by one behind per-key barriers; a completion thread
purges what Kafka acknowledged and resets what failed.

Per-key order: at most one record of a key is in flight. A record whose key is busy waits in that
key's FIFO while records of other keys keep flowing (no head-of-line blocking); when the in-flight
record of a key completes, the completion thread hands the next record of that key to the
publisher at once. A key's barrier is lowered only after its record's purge committed, so a
re-publish after a crash can repeat the last record of a key but never reorder it. (The log source
lowers it earlier and may keep several records of a key in flight:
:mod:`harvester.core.release_on_ack`.)

A failed delivery resets its record and forces a remark: queued records are discarded and the
leader id is refreshed, so the next mark picks up everything unacknowledged, in id order. A record
that waited behind its key longer than ``queue_timeout`` (usually a lost delivery report) forces a
remark too, as goharvest does.
"""

from __future__ import annotations

import queue
import threading
import time
from collections import deque
from collections.abc import Sequence
from uuid import UUID

import structlog

from harvester.core.dispatch import Context, Dispatcher, DispatcherFactory, worker
from harvester.core.failures import MalformedRecordError
from harvester.core.protocols import DeliveryReport, PublisherFactory, Purger
from harvester.core.records import MarkedRecord

log = structlog.get_logger("harvester.engine")

_COMPLETION_BATCH = 5000

_Report = DeliveryReport


class AtLeastOnceDispatcher:
    """:class:`harvester.core.dispatch.Dispatcher` with per-key barriers and batched completions."""

    def __init__(self, context: Context, store: Purger, publisher: PublisherFactory) -> None:
        self._ctx = context
        self._state = context.state
        self._bound = context.limits.in_flight_bound
        self._store = store
        # Guarded by state.cond:
        self._in_flight: dict[int, MarkedRecord] = {}
        self._busy: set[str] = set()
        # Per busy key, the records waiting behind it with the monotonic time they were queued.
        self._waiting: dict[str, deque[tuple[float, MarkedRecord]]] = {}
        # How many times each id waits in those FIFOs: a delivered record looks for its re-marked
        # copy here instead of scanning its key's FIFO (which grows with the queue per key). A plain
        # dict: a Counter's deletion is a Python-level method, once per record sent from a FIFO.
        self._waiting_ids: dict[int, int] = {}
        self._queued = 0
        # Ids purged while a mark query ran: the query may have returned them before the purge
        # committed, and dispatching them again would publish a duplicate.
        self._purged_during_mark: set[int] | None = None
        self._published = 0  # counted here, added to the Prometheus counter once per batch
        # Mark thread only:
        self._next_queue_check = 0.0
        # Delivery reports; None tells the completion thread to exit.
        self._acks: queue.SimpleQueue[_Report | None] = queue.SimpleQueue()
        self._publisher = publisher(self._acks.put_nowait)
        self._threads = [worker(self._completion_loop, "harvester-complete", context.labels)]

    @property
    def threads(self) -> Sequence[threading.Thread]:
        """The completion thread."""
        return self._threads

    def begin_term(self) -> None:
        """Beyond the fence, only the publisher's: a new term re-marks whatever is unacknowledged."""
        self._publisher.begin_term()

    def close(self, timeout: float) -> None:
        """Flush the publisher (bounded), then end the completion thread."""
        self._publisher.close(timeout)
        self._acks.put_nowait(None)

    # ------------------------------------------------------------------ state (caller holds the lock)

    def has_room(self) -> bool:
        return not self._window_full() and self._queued < self._ctx.limits.max_queued_records

    def busy(self) -> bool:
        return bool(self._in_flight)

    def _window_full(self) -> bool:
        return len(self._in_flight) >= self._bound

    def mark_started(self) -> None:
        self._purged_during_mark = set()

    def mark_ended(self) -> None:
        self._purged_during_mark = None

    def before_remark(self) -> None:
        self.discard_waiting()

    def discard_waiting(self) -> None:
        self._waiting.clear()
        self._waiting_ids.clear()
        self._queued = 0
        self._ctx.metrics.queued.set(0)

    def check_stuck(self) -> None:
        """Force a remark when a record waited behind its key longer than ``queue_timeout``."""
        now = time.monotonic()
        if now < self._next_queue_check or not self._waiting or self._state.leader_id is None:
            return
        timeout = self._ctx.limits.queue_timeout.total_seconds()
        self._next_queue_check = now + min(1.0, timeout)
        oldest = min(q[0][0] for q in self._waiting.values() if q)
        if now - oldest > timeout and not self._state.force_remark:
            log.warning("queue_timeout", waited=round(now - oldest, 3), queued=self._queued)
            self._state.force_remark = True

    @property
    def in_flight_records(self) -> int:
        return len(self._in_flight)

    @property
    def in_flight_keys(self) -> int:
        return len(self._busy)

    @property
    def queued_records(self) -> int:
        return self._queued

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, batch: Sequence[MarkedRecord], leader_id: UUID) -> None:
        """Send each record whose key is free, queue the others behind their keys; waits while
        the in-flight window is full."""
        state, metrics = self._state, self._ctx.metrics
        published = self._published
        now = time.monotonic()
        if not state.still_leader():  # asked without the lock: the elector may hold its own
            return
        with state.cond:
            purged = self._purged_during_mark or set()
            self._purged_during_mark = None
            for record in batch:
                # state.current(), inlined: per record, identity first (UUID's == is Python code).
                current = state.leader_id
                if (current is not leader_id and current != leader_id) or state.force_remark:
                    return  # the rest is re-marked after the refresh
                if record.id in purged:
                    continue
                key = record.key
                if key in self._busy or key in self._waiting or record.id in self._in_flight:
                    # Includes a re-marked copy of a record in flight (whose key is busy unless it
                    # may have several in flight): it is dropped if that record completes, and is
                    # the retry if that record fails.
                    self._waiting.setdefault(key, deque()).append((now, record))
                    self._waiting_ids[record.id] = self._waiting_ids.get(record.id, 0) + 1
                    self._queued += 1
                    continue
                while self._window_full() and state.current(leader_id):
                    state.cond.wait(0.05)
                if not state.current(leader_id):
                    return
                self._send(record)
            metrics.queued.set(self._queued)
            metrics.in_flight.set(len(self._in_flight))
        metrics.published.inc(self._published - published)

    def _send(self, record: MarkedRecord) -> None:
        # Caller holds the lock; publish() never blocks on it (reports go to a queue).
        self._in_flight[record.id] = record
        self._occupy(record.key)
        if record.malformed is not None:
            self._acks.put_nowait((record, MalformedRecordError(record.malformed)))
            return
        self._publisher.publish(record)
        self._published += 1

    def _occupy(self, key: str) -> None:
        """A record of ``key`` goes out: the key is busy until it completes."""
        self._busy.add(key)

    # ------------------------------------------------------------------ completion

    def _completion_loop(self) -> None:
        while True:
            first = self._acks.get()
            if first is None:
                self._completions_ended()
                return
            items = [first]
            while len(items) < _COMPLETION_BATCH:
                try:
                    item = self._acks.get_nowait()
                except queue.Empty:
                    break
                if item is None:
                    self._acks.put_nowait(None)
                    break
                items.append(item)
            try:
                self._complete(items)
            except Exception:
                # Never let the completion thread die: its records would hold their keys for good.
                # A remark re-publishes whatever was not purged.
                log.exception("completion_failed", records=len(items))
                self._abandon(items)

    def _completions_ended(self) -> None:
        """The completion thread is about to exit: every report before close() was handled."""

    def _abandon(self, items: list[_Report]) -> None:
        """Free the keys of records whose completion failed, and force a remark."""
        with self._state.cond:
            for record, _ in items:
                self._in_flight.pop(record.id, None)
                self._busy.discard(record.key)
            self._state.force_remark = True
            self._state.cond.notify_all()

    def _purge_and_settle(
        self, items: list[_Report]
    ) -> tuple[list[MarkedRecord], list[tuple[MarkedRecord, Exception]]]:
        """Purge the acknowledged records of ``items`` and settle the failed ones; (delivered, failed)."""
        settler = self._ctx.settler
        delivered = [r for r, err in items if err is None]
        failures = [(r, err) for r, err in items if err is not None]
        # Fenced: the records stay for the new leader; only bookkeeping is left.
        if settler.retry("purge", self._store.purge, [r.id for r in delivered]):
            settler.delivered(delivered)
            settler.settle(failures)
        return delivered, failures

    def _complete(self, items: list[_Report]) -> None:
        state, metrics = self._state, self._ctx.metrics
        _, failures = self._purge_and_settle(items)
        may_send = state.still_leader()
        with state.cond:
            if failures:
                state.force_remark = True
            published = self._published
            for record, err in items:
                self._in_flight.pop(record.id, None)
                self._busy.discard(record.key)
                if err is None and self._purged_during_mark is not None:
                    self._purged_during_mark.add(record.id)
                self._release(record, delivered=err is None, may_send=may_send)
            metrics.in_flight.set(len(self._in_flight))
            metrics.queued.set(self._queued)
            state.cond.notify_all()
            released = self._published - published
        metrics.published.inc(released)

    def _release(self, record: MarkedRecord, delivered: bool, may_send: bool) -> None:
        """Lower ``record``'s key barrier and send the key's next waiting record, if any (caller
        holds the lock)."""
        waiting = self._waiting.get(record.key)
        if not waiting:
            return
        if delivered and record.id in self._waiting_ids:
            kept = deque(entry for entry in waiting if entry[1].id != record.id)
            self._queued -= len(waiting) - len(kept)
            del self._waiting_ids[record.id]
            waiting = self._waiting[record.key] = kept
        if waiting and may_send and self._state.leader_id is not None and not self._state.force_remark:
            self._queued -= 1
            follower = waiting.popleft()[1]
            left = self._waiting_ids.pop(follower.id, 1) - 1
            if left:
                self._waiting_ids[follower.id] = left
            self._send(follower)
        if not waiting:
            del self._waiting[record.key]


def at_least_once(store: Purger, publisher: PublisherFactory) -> DispatcherFactory:
    """The at-least-once mode over ``store`` and ``publisher``, as :class:`~harvester.core.engine.Engine`
    takes it."""

    def build(context: Context) -> Dispatcher:
        if store.release_on_ack:
            # A subclass of this module's dispatcher, so imported here rather than at the top.
            from harvester.core.release_on_ack import AckReleasingDispatcher

            return AckReleasingDispatcher(context, store, publisher)
        return AtLeastOnceDispatcher(context, store, publisher)

    return build

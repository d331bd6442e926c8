"""At-least-once delivery: each record goes out behind its key's barrier (those a batch lets through
published together); a completion thread takes Kafka's answers, purges what it acknowledged and
resets what failed.

Per-key order: a record whose key has no room waits in that key's FIFO while records of other keys
keep flowing (no head-of-line blocking); when a record of the key is done, the key's next record
goes out at once. When a key has room again is the :class:`~harvester.core.gate.KeyGate`'s
:class:`~harvester.core.gate.ReleasePolicy`: after its record's purge committed (mark-purge/reset
with ``keyRelease: purged``), or, for a store that allows it (the default), at Kafka's
acknowledgement within a bounded run of unpurged records, with the purges on a thread of their own
(:mod:`harvester.core.purge_thread`).

A failed delivery resets its record and forces a remark: queued records are discarded and the
leader id is refreshed, so the next mark picks up everything unacknowledged, in id order. A record
that waited behind its key longer than ``queue_timeout`` (usually a lost delivery report) forces a
remark too, as goharvest does.

A record that must go out alone (:attr:`harvester.core.settle.Settler.solo`: Kafka refused a batch it
shared) is sent once nothing is in flight, and nothing else is sent until Kafka answered it, so that
its answer is about it alone.
"""

from __future__ import annotations

import queue
import threading
import time
from collections.abc import Iterable, Sequence
from uuid import UUID

import structlog

from harvester.core.dispatch import Context, Dispatcher, DispatcherFactory, worker
from harvester.core.failures import MalformedRecordError
from harvester.core.gate import RELEASE_AT_PURGE, KeyGate, release_at_ack
from harvester.core.protocols import DeliveryReport, PublisherFactory, Purger, RefusedError
from harvester.core.purge_thread import PurgeThread
from harvester.core.records import MarkedRecord

log = structlog.get_logger("harvester.engine")

_COMPLETION_BATCH = 5000


def _keys(items: Sequence[DeliveryReport]) -> list[str]:
    return [record.key for record, _ in items]


class AtLeastOnceDispatcher:
    """:class:`harvester.core.dispatch.Dispatcher` with a per-key gate and batched completions."""

    def __init__(self, context: Context, store: Purger, publisher: PublisherFactory) -> None:
        self._ctx = context
        self._state = context.state
        self._bound = context.limits.in_flight_bound
        self._store = store
        # Delivery reports; None tells the completion thread to exit.
        self._acks: queue.SimpleQueue[DeliveryReport | None] = queue.SimpleQueue()
        self._publisher = publisher(self._acks.put_nowait)
        # Guarded by state.cond:
        policy = release_at_ack(self._publisher.keeps_order) if store.release_on_ack else RELEASE_AT_PURGE
        self._gate = KeyGate(policy)
        # Ids purged while a mark query ran: the query may have returned them before the purge
        # committed, and dispatching them again would publish a duplicate.
        self._purged_during_mark: set[int] | None = None
        self._published = 0  # counted here, added to the Prometheus counter once per batch
        self._solo: int | None = None  # the id of the record out alone, until Kafka answered it
        # Mark thread only:
        self._next_queue_check = 0.0
        self._threads = [worker(self._completion_loop, "harvester-complete", context.labels)]
        self._purges: PurgeThread | None = None
        if policy.releases_at_ack:
            self._purges = PurgeThread(self._finish, lambda: self._gate.holding, context.labels)
            self._threads.append(self._purges.thread)

    @property
    def threads(self) -> Sequence[threading.Thread]:
        """The completion thread, and the purge thread when purges run apart."""
        return self._threads

    def begin_term(self) -> None:
        """Beyond the fence, only the publisher's: a new term re-marks whatever is unacknowledged,
        from the store's position (what was held is counted again if it goes out again)."""
        self._publisher.begin_term()
        with self._state.cond:
            self._gate.new_term()

    def close(self, timeout: float) -> None:
        """Flush the publisher (bounded), then end the completion (and purge) thread."""
        self._publisher.close(timeout)
        self._acks.put_nowait(None)

    # ------------------------------------------------------------------ state (caller holds the lock)

    def has_room(self) -> bool:
        return self._gate.window < self._bound and self._gate.queued_records < self._ctx.limits.max_queued_records

    def busy(self) -> bool:
        return self._gate.busy()

    def mark_started(self) -> None:
        self._purged_during_mark = set()

    def mark_ended(self) -> None:
        self._purged_during_mark = None

    def before_remark(self) -> None:
        self.discard_waiting()

    def discard_waiting(self) -> None:
        self._gate.discard_waiting()
        self._ctx.metrics.queued.set(0)

    def check_stuck(self) -> None:
        """Force a remark when a record waited behind its key longer than ``queue_timeout``."""
        now = time.monotonic()
        if now < self._next_queue_check or not self._gate.queued_records or self._state.leader_id is None:
            return
        timeout = self._ctx.limits.queue_timeout.total_seconds()
        self._next_queue_check = now + min(1.0, timeout)
        oldest = self._gate.oldest_wait()
        if oldest is not None and now - oldest > timeout and not self._state.force_remark:
            log.warning("queue_timeout", waited=round(now - oldest, 3), queued=self._gate.queued_records)
            self._state.force_remark = True

    @property
    def in_flight_records(self) -> int:
        return self._gate.in_flight_records

    @property
    def in_flight_keys(self) -> int:
        return self._gate.in_flight_keys

    @property
    def queued_records(self) -> int:
        return self._gate.queued_records

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, batch: Sequence[MarkedRecord], leader_id: UUID) -> None:
        """Send each record whose key has room, queue the others behind their keys; waits while
        the in-flight window is full."""
        state, metrics, gate, bound = self._state, self._ctx.metrics, self._gate, self._bound
        now = time.monotonic()
        solo = self._ctx.settler.solo
        if not state.still_leader():  # asked without the lock: the elector may hold its own
            return
        with state.cond:
            purged = self._purged_during_mark or set()
            self._purged_during_mark = None
            sent: list[MarkedRecord] = []  # counted as sent, published at once before any wait
            # Counted here: what the completion thread publishes during a wait, it counts itself.
            published = 0
            # The window's room, counted down here: under the lock only this loop's sends fill it.
            room = bound - gate.window
            try:
                for record in batch:
                    # state.current(), inlined: per record, identity first (UUID's == is Python code).
                    current = state.leader_id
                    if (current is not leader_id and current != leader_id) or state.force_remark:
                        return  # the rest is re-marked after the refresh
                    if record.id in purged or gate.hold_back(record, now):
                        continue
                    alone = record.id in solo if solo else False
                    if room <= 0 or self._solo is not None or (alone and gate.in_flight_records):
                        published += self._publish(sent)  # the window frees as they are answered
                        sent = []
                        while (
                            gate.window >= bound or self._solo is not None or (alone and gate.in_flight_records)
                        ) and state.current(leader_id):
                            state.cond.wait(0.05)
                        if not state.current(leader_id):
                            return
                        room = bound - gate.window
                    gate.sent(record)
                    room -= 1
                    sent.append(record)
                    if alone:
                        self._solo = record.id
                        published += self._publish(sent)
                        sent = []
            finally:
                published += self._publish(sent)
                metrics.queued.set(gate.queued_records)
                metrics.in_flight.set(gate.in_flight_records)
                metrics.published.inc(published)

    def _publish(self, records: list[MarkedRecord]) -> int:
        """Publish ``records``, counted as sent (caller holds the lock; publish() never blocks on it:
        reports go to a queue); how many were. A malformed record, or those the publisher raised on,
        are reported failed."""
        if not records:
            return 0
        acks = self._acks
        if any(record.malformed is not None for record in records):
            for record in records:
                if record.malformed is not None:
                    acks.put_nowait((record, MalformedRecordError(record.malformed)))
            records = [record for record in records if record.malformed is None]
        try:
            self._publisher.publish(records)
        except Exception as exc:
            if isinstance(exc, RefusedError):  # said once, in one line, by the engine, which stops leading
                self._ctx.on_refused(exc)
            else:
                # Not left in flight for good: settled as failed deliveries, then re-marked.
                log.exception("publish_failed", records=len(records))
            for record in records:
                acks.put_nowait((record, exc))
            return 0
        self._published += len(records)
        return len(records)

    def _send_waiting(self, keys: Iterable[str], may_send: bool) -> None:
        """Send the records waiting behind ``keys`` while their keys have room (caller holds the
        lock); not after a failure or a lost leadership: the remark marks them again."""
        state, solo = self._state, self._ctx.settler.solo
        if not self._gate.queued_records:  # nothing waits behind any key (the usual case): nothing to take
            return
        if may_send and state.leader_id is not None and not state.force_remark and self._solo is None:
            taken = self._gate.take([*keys, *self._gate.parked], solo)
            if taken and taken[-1].id in solo:
                self._solo = taken[-1].id
            self._publish(taken)

    def _answered(self, items: Sequence[DeliveryReport]) -> list[str]:
        """Keys to look for records to send after ``items`` were answered: theirs, and every key
        waiting when they end a record's time alone (caller holds the lock); none while nothing waits."""
        keys = _keys(items) if self._gate.queued_records else []
        if self._solo is not None and any(record.id == self._solo for record, _ in items):
            self._solo = None
            keys += self._gate.waiting_keys
        return keys

    # ------------------------------------------------------------------ completion

    def _completion_loop(self) -> None:
        while True:
            first = self._acks.get()
            if first is None:
                if self._purges is not None:
                    self._purges.close()
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
            refused = next((err for _, err in items if isinstance(err, RefusedError)), None)
            if refused is not None:  # the records are settled as failed below, and stay in the outbox
                self._ctx.on_refused(refused)
            try:
                if self._purges is None:
                    # The keys wait for their purges: purge here, without a thread hop.
                    self._finish(items, answered=False)
                else:
                    self._answer(items, self._purges)
            except Exception:
                # Never let the completion thread die: reports would stop being taken. A remark
                # re-publishes whatever was not purged.
                log.exception("completion_failed", records=len(items))
                self._state.request_remark()

    def _answer(self, items: list[DeliveryReport], purges: PurgeThread) -> None:
        """Count ``items`` answered, send what the acknowledgements made room for, and hand them to
        the purge thread."""
        state, metrics = self._state, self._ctx.metrics
        may_send = state.still_leader()
        with state.cond:
            published = self._published
            self._gate.answered(items)
            purges.put(items)
            self._send_waiting(self._answered(items), may_send)
            metrics.in_flight.set(self._gate.in_flight_records)
            metrics.queued.set(self._gate.queued_records)
            state.cond.notify_all()
            released = self._published - published
        metrics.published.inc(released)

    def _finish(self, items: list[DeliveryReport], answered: bool = True) -> None:
        """Purge the acknowledged records of ``items`` and settle the failed ones, then send what
        that made room for; after the remark a failure forced, a key's next record is likely its
        re-marked copy. ``answered``: whether the gate counted them answered already."""
        state, metrics, gate = self._state, self._ctx.metrics, self._gate
        settler = self._ctx.settler
        delivered = [r for r, err in items if err is None]
        failures = [(r, err) for r, err in items if err is not None]
        dead: set[int] = set()
        try:
            # Fenced: the records stay for the new leader; only bookkeeping is left.
            if settler.retry("purge", self._store.purge, [r.id for r in delivered]):
                settler.delivered(delivered)
                dead = settler.settle(failures)
            covered = self._store.durable([r.id for r in delivered])
        except Exception:
            # As in any completion: a remark re-publishes whatever was not purged.
            log.exception("purge_failed", records=len(items))
            with state.cond:
                if not answered:
                    gate.answered(items)
                    self._answered(items)
                gate.abandon(items)
                state.force_remark = True
                state.cond.notify_all()
            return
        may_send = state.still_leader()
        with state.cond:
            published = self._published
            if self._purged_during_mark is not None:
                # A copy the running mark hands out must not go out: delivered, or dead-lettered.
                self._purged_during_mark.update(r.id for r in delivered)
                self._purged_during_mark.update(dead)
            if answered:
                earlier = gate.done(delivered, covered, failures, dead)
                keys = _keys(items) if gate.queued_records else []
            else:
                earlier = gate.completed(items, covered, failures, dead)
                keys = self._answered(items)
            if failures:
                # Only now: the remark reads each failure's attempts as its settlement left them.
                state.force_remark = True
            self._send_waiting(keys + earlier, may_send)
            metrics.in_flight.set(gate.in_flight_records)
            metrics.queued.set(gate.queued_records)
            state.cond.notify_all()
            released = self._published - published
        metrics.published.inc(released)


def at_least_once(store: Purger, publisher: PublisherFactory) -> DispatcherFactory:
    """The at-least-once mode over ``store`` and ``publisher``, as :class:`~harvester.core.engine.Engine`
    takes it."""

    def build(context: Context) -> Dispatcher:
        return AtLeastOnceDispatcher(context, store, publisher)

    return build

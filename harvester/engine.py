"""The mark-purge/reset (MP/R) engine.

Two threads do the work:

* the **mark thread** marks a batch of records under the current leader id and dispatches them;
* the **completion thread** takes delivery reports in batches, purges the delivered records and
  resets the failed ones (one statement each), then lowers their keys' barriers.

Per-key order: at most one record of a key is in flight. A record whose key is busy waits in that
key's FIFO while records of other keys keep flowing (no head-of-line blocking); when the in-flight
record of a key completes, the completion thread hands the next record of that key to the
publisher at once. A key's barrier is lowered only after its record's purge committed, so a
re-publish after a crash can repeat the last record of a key but never reorder it.

A failed delivery resets its record and forces a remark: queued records are discarded and the
leader id is refreshed, so the next mark picks up everything unacknowledged, in id order.

Poison records: a failure is *retriable* (the broker or network) or *permanent* (the record).
Retriable failures back off exponentially, with jitter, without counting against the record.
Permanent ones count attempts (in the table when it has the attempt columns, else in memory);
at ``max_attempts`` the record moves to the dead-letter table, which releases its key.

Zombie fencing: each leadership term first bumps the store's epoch; every mark, purge and reset
is checked against it in the database. A statement refused by the fence means a newer leader has
taken over: leader work stops at once (LeaderFenced) and nothing is retried.
"""

from __future__ import annotations

import functools
import queue
import random
import threading
import time
from collections import deque
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from typing import TypeVar
from uuid import UUID, uuid4

import structlog

from harvester.classify import MalformedRecordError, classify, reason
from harvester.config import Limits
from harvester.events import Event, LeaderAcquired, LeaderFenced, LeaderRefreshed, LeaderRevoked
from harvester.metrics import HarvesterMetrics
from harvester.protocols import (
    FencedError,
    ProducerFencedError,
    Publisher,
    Store,
    StoreError,
    TransactionAbortedError,
    TransactionalPublisher,
)
from harvester.record import Failure, MarkedRecord
from leader.events import LeaderEvent

log = structlog.get_logger("harvester.engine")

_COMPLETION_BATCH = 5000
_T = TypeVar("_T")


def _logged(loop: Callable[[], None]) -> Callable[[], None]:
    """``loop``, logging the error that ends it: the thread is gone then (see :attr:`Engine.alive`)."""

    def run() -> None:
        try:
            loop()
        except Exception:
            log.exception("thread_died", thread=threading.current_thread().name)

    return run


class Engine:
    """MP/R over a :class:`Store` and a :class:`Publisher`, driven by leadership events."""

    def __init__(
        self,
        store: Store,
        publisher_factory: Callable[[Callable[[MarkedRecord, Exception | None], None]], Publisher],
        limits: Limits,
        metrics: HarvesterMetrics,
        emit: Callable[[Event], None],
        *,
        listen_notify: bool = True,
        still_leader: Callable[[], bool] = lambda: True,
        transactions: TransactionalPublisher | None = None,
    ) -> None:
        self._store = store
        # Exactly-once mode: batches go out in Kafka transactions instead of record by record.
        self._txn = transactions
        # The elector's live view: it turns false the moment heartbeats are overdue, before the
        # LeaderFenced event is delivered, so a process resuming from a freeze publishes nothing.
        self._still_leader = still_leader
        self._limits = limits
        self._metrics = metrics
        self._emit = emit
        self._listen = listen_notify
        self._cond = threading.Condition()
        # All of the following is guarded by self._cond.
        self._leader_id: UUID | None = None
        self._term = 0  # bumped on every LeaderAcquired
        self._fenced_term = 0  # the term whose epoch the store holds
        self._epoch = 0
        self._force_remark = False
        self._in_flight: dict[int, MarkedRecord] = {}
        self._busy: set[str] = set()
        # Per busy key, the records waiting behind it with the monotonic time they were queued.
        self._waiting: dict[str, deque[tuple[float, MarkedRecord]]] = {}
        self._next_queue_check = 0.0
        self._queued = 0
        self._published = 0  # counted here, added to the Prometheus counter once per batch
        # Ids purged while a mark query ran: the query may have returned them before the purge
        # committed, and dispatching them again would publish a duplicate.
        self._purged_during_mark: set[int] | None = None
        # Delivery reports; None tells the completion thread to exit.
        # Attempts of permanently failing records, when the table cannot keep them (by id).
        self._attempts: dict[int, tuple[int, datetime]] = {}
        self._retry_round = 0
        self._resume_at = 0.0  # monotonic time before which no mark runs (retriable back-off)
        if not store.tracks_attempts:
            log.warning("attempts_in_memory", hint="run 'reaper migrate' so attempt counts survive failover")
        self._acks: queue.SimpleQueue[tuple[MarkedRecord, Exception | None] | None] = queue.SimpleQueue()
        self._stopping = threading.Event()
        self._publisher = publisher_factory(self._on_delivery) if transactions is None else None
        # Exactly-once: committed batches waiting for their purge, which overlaps the next batch.
        self._purge_jobs: queue.SimpleQueue[tuple[list[MarkedRecord], int] | None] = queue.SimpleQueue()
        self._pending_purges = 0
        self._threads = [
            threading.Thread(target=_logged(self._mark_loop), name="harvester-mark", daemon=True),
            threading.Thread(
                target=_logged(self._completion_loop if transactions is None else self._purge_loop),
                name="harvester-complete",
                daemon=True,
            ),
        ]

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the mark and completion threads."""
        for t in self._threads:
            t.start()

    def stop_marking(self) -> None:
        """Stop marking and publishing; in-flight records still complete."""
        self._stopping.set()
        with self._cond:
            self._leader_id = None
            self._discard_waiting()
            self._cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` until no record is in flight; True if none is."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while self._in_flight or self._pending_purges:
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._cond.wait(min(left, 0.1))
        return True

    def close(self, timeout: float) -> None:
        """Stop both threads and the publisher (after :meth:`stop_marking` and :meth:`drain`)."""
        self.stop_marking()
        if self._publisher is not None:
            self._publisher.close(timeout)
        if self._txn is not None:
            self._txn.close(timeout)
        self._acks.put_nowait(None)
        self._purge_jobs.put_nowait(None)
        for t in self._threads:
            t.join(timeout)

    # ------------------------------------------------------------------ state

    @property
    def alive(self) -> bool:
        """False when a worker thread died while the engine should run: a bug, which only a restart
        of the process repairs (the reaper's liveness probe reports it)."""
        return self._stopping.is_set() or all(t.is_alive() for t in self._threads)

    @property
    def leader_id(self) -> UUID | None:
        """The id records are currently marked with, or None when not leading."""
        return self._leader_id

    @property
    def in_flight_records(self) -> int:
        """Records published and not yet completed."""
        return len(self._in_flight)

    @property
    def in_flight_keys(self) -> int:
        """Keys with a record in flight."""
        return len(self._busy)

    @property
    def queued_records(self) -> int:
        """Marked records waiting behind a busy key."""
        return self._queued

    # ------------------------------------------------------------------ leadership

    def on_leader_event(self, event: LeaderEvent) -> None:
        """Elector callback: start, stop or (for a revocation) wind down leader work."""
        if isinstance(event, LeaderAcquired):
            with self._cond:
                if not self._stopping.is_set():
                    self._leader_id = event.leader_id
                    self._term += 1
                    self._force_remark = False
                    self._discard_waiting()
                    self._cond.notify_all()
            self._metrics.is_leader.set(1)
        elif isinstance(event, LeaderFenced):
            # Must not block: stop publishing now; records in flight still complete.
            self._lose_leadership()
            self._metrics.fenced.inc()
        elif isinstance(event, LeaderRevoked):
            self._lose_leadership()
            # The partition is released when this returns: let in-flight work finish first (unless
            # stopping: stop() already waited as long as its caller allowed).
            if not self._stopping.is_set() and not self.drain(self._limits.drain_interval.total_seconds()):
                log.warning("revoke_drain_timeout", in_flight=self.in_flight_records)
        self._emit(event)

    def _lose_leadership(self) -> None:
        with self._cond:
            self._leader_id = None
            self._discard_waiting()
            self._cond.notify_all()
        self._metrics.is_leader.set(0)

    def _check_queue_timeout(self) -> None:
        """Force a remark when a record waited behind its key longer than ``queue_timeout`` (a key
        stuck that long usually means a lost delivery report). Caller holds the lock."""
        now = time.monotonic()
        if now < self._next_queue_check or not self._waiting or self._leader_id is None:
            return
        timeout = self._limits.queue_timeout.total_seconds()
        self._next_queue_check = now + min(1.0, timeout)
        oldest = min(q[0][0] for q in self._waiting.values() if q)
        if now - oldest > timeout and not self._force_remark:
            log.warning("queue_timeout", waited=round(now - oldest, 3), queued=self._queued)
            self._force_remark = True

    def _discard_waiting(self) -> None:
        self._waiting.clear()
        self._queued = 0
        self._metrics.queued.set(0)

    # ------------------------------------------------------------------ marking

    def _mark_loop(self) -> None:
        limits = self._limits
        idle = limits.mark_backoff.total_seconds()
        while not self._stopping.is_set():
            refreshed: LeaderRefreshed | None = None
            with self._cond:
                while not self._stopping.is_set() and (
                    self._leader_id is None
                    or len(self._in_flight) >= limits.max_in_flight_records
                    or self._queued >= limits.max_queued_records
                ):
                    self._check_queue_timeout()
                    if self._force_remark:
                        break
                    self._cond.wait(0.1)
                self._check_queue_timeout()
                if self._stopping.is_set() or self._leader_id is None:
                    continue
                term, term_leader = self._term, self._leader_id
            if self._fenced_term != term:
                self._begin_term(term, term_leader)
                continue
            with self._cond:
                if self._leader_id is None or self._term != term:
                    continue
                if self._force_remark:
                    self._discard_waiting()
                    # A pending purge's records are marked with the current id: let it finish, or
                    # the refreshed id would mark (and publish) them again.
                    while self._pending_purges and not self._stopping.is_set():
                        self._cond.wait(0.05)
                    previous, self._leader_id = self._leader_id, uuid4()
                    self._force_remark = False
                    refreshed = LeaderRefreshed(self._leader_id, previous)
                leader_id = self._leader_id
                self._purged_during_mark = set()
            if refreshed is not None:
                self._metrics.remarks.inc()
                log.info("leader_refreshed", leader_id=str(refreshed.leader_id))
                self._emit(refreshed)
            pause = self._resume_at - time.monotonic()
            if pause > 0:
                self._stopping.wait(pause)
                continue
            started = time.perf_counter()
            try:
                batch = self._store.mark(leader_id, limits.mark_query_records)
            except FencedError as exc:
                with self._cond:
                    self._purged_during_mark = None
                self._fenced(exc)
                continue
            except StoreError as exc:
                log.warning("mark_failed", error=str(exc))
                with self._cond:
                    self._purged_during_mark = None
                    self._force_remark = True
                self._stopping.wait(limits.io_error_backoff.total_seconds())
                continue
            self._metrics.mark_seconds.observe(time.perf_counter() - started)
            if batch:
                idle = limits.mark_backoff.total_seconds()
                self._dispatch(batch, leader_id)
                continue
            with self._cond:
                self._purged_during_mark = None
            self._idle_wait(idle)
            idle = min(idle * 2, limits.max_mark_backoff.total_seconds())

    def _begin_term(self, term: int, leader_id: UUID) -> None:
        """Bump the fence epoch for a new term before its first mark; in exactly-once mode also
        fence the previous producer and purge what its committed checkpoints name."""
        try:
            epoch = self._store.acquire(leader_id)
            if self._txn is not None:
                self._recover(self._txn)
        except ProducerFencedError as exc:
            self._fenced(FencedError(str(exc)))
            return
        except FencedError as exc:
            self._fenced(exc)
            return
        except (StoreError, TransactionAbortedError) as exc:
            log.warning("term_start_failed", error=str(exc))
            self._stopping.wait(self._limits.io_error_backoff.total_seconds())
            return
        self._fenced_term = term
        self._epoch = epoch
        self._metrics.epoch.set(epoch)
        log.info("fence_acquired", epoch=epoch, leader_id=str(leader_id))

    def _recover(self, txn: TransactionalPublisher) -> None:
        started = time.perf_counter()
        txn.init()
        position = self._store.checkpoint_position()
        ids, end = txn.recover(position)
        self._store.purge_checkpointed(ids, end)
        self._metrics.recoveries.inc()
        self._metrics.recovery_seconds.observe(time.perf_counter() - started)
        seconds = round(time.perf_counter() - started, 3)
        log.info("checkpoints_recovered", purged=len(ids), position=end, seconds=seconds)

    def _fenced(self, error: FencedError) -> None:
        """A newer epoch or producer fenced this process. If the elector says another process leads,
        drop leader work now and report it, never retrying. If this process still leads, the fence
        came from a stale instance (one that was paused during its own term start and finished it
        late): start the term again, which fences that instance in turn."""
        if self._still_leader() and not self._stopping.is_set():
            with self._cond:
                if self._leader_id is not None:
                    self._fenced_term = 0
                    self._force_remark = True
                    self._discard_waiting()
                    self._cond.notify_all()
                    self._metrics.fenced_statements.inc()
                    log.warning("fence_taken_back", error=str(error))
                    return
        with self._cond:
            leader_id, self._leader_id = self._leader_id, None
            self._discard_waiting()
            self._cond.notify_all()
        self._metrics.fenced_statements.inc()
        self._metrics.is_leader.set(0)
        if leader_id is not None:
            self._metrics.fenced.inc()
            log.error("fenced_by_newer_leader", error=str(error), leader_id=str(leader_id))
            self._emit(LeaderFenced(leader_id))

    def _idle_wait(self, seconds: float) -> None:
        """Back off on an empty outbox; a NOTIFY from the outbox trigger ends the wait early."""
        if not self._listen:
            self._stopping.wait(seconds)
            return
        try:
            self._store.wait_for_insert(seconds)
        except StoreError as exc:
            log.warning("listen_failed", error=str(exc))
            self._stopping.wait(self._limits.io_error_backoff.total_seconds())

    def _dispatch(self, batch: Sequence[MarkedRecord], leader_id: UUID) -> None:
        if self._txn is not None:
            self._dispatch_transaction(self._txn, batch, leader_id)
            return
        max_in_flight = self._limits.max_in_flight_records
        published = self._published
        if not self._still_leader():
            return
        with self._cond:
            purged = self._purged_during_mark or set()
            self._purged_during_mark = None
            for record in batch:
                if self._leader_id != leader_id or self._force_remark:
                    return  # the rest is re-marked after the refresh
                if record.id in purged:
                    continue
                key = record.key
                if key in self._busy or key in self._waiting:
                    # Includes a re-marked copy of the record in flight: it is dropped if that
                    # record completes, and is the retry if that record fails.
                    self._waiting.setdefault(key, deque()).append((time.monotonic(), record))
                    self._queued += 1
                    continue
                while len(self._in_flight) >= max_in_flight and self._leader_id == leader_id and not self._force_remark:
                    self._cond.wait(0.05)
                if self._leader_id != leader_id or self._force_remark:
                    return
                self._send(record)
            self._metrics.queued.set(self._queued)
            self._metrics.in_flight.set(len(self._in_flight))
        self._metrics.published.inc(self._published - published)

    def _dispatch_transaction(
        self, txn: TransactionalPublisher, batch: Sequence[MarkedRecord], leader_id: UUID
    ) -> None:
        """Publish a whole batch in one transaction. No per-key barrier is needed: the batch commits
        all or nothing, in id order, and the next one starts only after this one is purged."""
        with self._cond:
            self._purged_during_mark = None
            if self._leader_id != leader_id or self._force_remark or not self._still_leader():
                return
        # A malformed row and the later records of its key wait; everything else goes out now.
        blocked = {r.key for r in batch if r.malformed is not None}
        good = [r for r in batch if r.key not in blocked]
        failures: list[tuple[MarkedRecord, Exception]] = [
            (r, MalformedRecordError(r.malformed)) for r in batch if r.malformed is not None
        ]
        if good:
            try:
                position = txn.publish_batch(good, self._epoch)
            except ProducerFencedError as exc:
                self._fenced(FencedError(str(exc)))
                return
            except TransactionAbortedError as exc:
                self._metrics.transactions_aborted.inc()
                log.warning("transaction_aborted", error=str(exc), records=len(good))
                failures += [(r, exc.failures[r.id]) for r in good if r.id in exc.failures]
                if not exc.failures:
                    self._back_off()
                good = []
            else:
                self._metrics.transactions_committed.inc()
                self._metrics.published.inc(len(good))
                with self._cond:
                    while self._pending_purges >= 2 and not self._stopping.is_set():
                        self._cond.wait(0.05)
                    self._pending_purges += 1
                self._purge_jobs.put_nowait((good, position))
        if failures or len(good) < len(batch):
            self._settle(failures)
            with self._cond:
                self._force_remark = True

    def _send(self, record: MarkedRecord) -> None:
        # Caller holds self._cond; publish() never blocks on our lock (reports go to a queue).
        self._in_flight[record.id] = record
        self._busy.add(record.key)
        if record.malformed is not None or self._publisher is None:
            self._acks.put_nowait((record, MalformedRecordError(record.malformed or "no publisher")))
            return
        self._publisher.publish(record)
        self._published += 1

    # ------------------------------------------------------------------ completion

    def _on_delivery(self, record: MarkedRecord, error: Exception | None) -> None:
        self._acks.put_nowait((record, error))

    def _completion_loop(self) -> None:
        while True:
            first = self._acks.get()
            if first is None:
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
                with self._cond:
                    for record, _ in items:
                        self._in_flight.pop(record.id, None)
                        self._busy.discard(record.key)
                    self._force_remark = True
                    self._cond.notify_all()

    def _complete(self, items: list[tuple[MarkedRecord, Exception | None]]) -> None:
        delivered = [r for r, err in items if err is None]
        failures = [(r, err) for r, err in items if err is not None]
        # Fenced: the records stay marked for the new leader to re-mark; only bookkeeping is left.
        if self._with_retry(self._store.purge, [r.id for r in delivered]):
            self._delivered(delivered)
            self._settle(failures)
        may_send = self._still_leader()
        with self._cond:
            if failures:
                self._force_remark = True
            published = self._published
            for record, err in items:
                self._in_flight.pop(record.id, None)
                self._busy.discard(record.key)
                if err is None and self._purged_during_mark is not None:
                    self._purged_during_mark.add(record.id)
                self._release(record, delivered=err is None, may_send=may_send)
            self._metrics.in_flight.set(len(self._in_flight))
            self._metrics.queued.set(self._queued)
            self._cond.notify_all()
            released = self._published - published
        self._metrics.published.inc(released)

    def _delivered(self, records: Sequence[MarkedRecord]) -> None:
        """Account for purged records: metrics, and the end of any retry back-off."""
        if not records:
            return
        now = time.time()
        for record in records:
            self._metrics.publish_latency.observe(max(0.0, now - record.create_time.timestamp()))
            self._attempts.pop(record.id, None)
        self._metrics.purged.inc(len(records))
        self._retry_round = 0

    def _settle(self, failures: Sequence[tuple[MarkedRecord, Exception]]) -> bool:
        """Record failed deliveries: reset the retriable ones (and back off), count attempts of the
        permanent ones and dead-letter those out of attempts. False if the fence refused it."""
        if not failures:
            return True
        retriable: list[int] = []
        failing: list[Failure] = []
        dead: list[Failure] = []
        for record, err in failures:
            log.warning("delivery_failed", id=record.id, key=record.key, topic=record.topic, error=str(err))
            kind = classify(err)
            self._metrics.retries.labels(kind).inc()
            if kind == "retriable":
                retriable.append(record.id)
                continue
            failure = self._count_attempt(record, err)
            (dead if failure.attempts >= self._limits.max_attempts else failing).append(failure)
        leader_id = self._leader_id
        if not (
            self._with_retry(self._store.reset, retriable)
            and self._with_retry(self._store.fail, failing)
            and (leader_id is None or self._with_retry(lambda f: self._store.dead_letter(f, leader_id), dead))
        ):
            return False
        self._metrics.reset.inc(len(retriable) + len(failing))
        if retriable:
            self._back_off()
        for f in dead:
            self._attempts.pop(f.id, None)
            self._metrics.dead_lettered.labels(f.reason).inc()
            log.error("dead_lettered", id=f.id, key=f.key, reason=f.reason, attempts=f.attempts, error=f.error)
        return True

    def _back_off(self) -> None:
        """Delay the next mark after retriable failures: exponential, capped, with jitter."""
        limits = self._limits
        base, cap = limits.retry_backoff.total_seconds(), limits.max_retry_backoff.total_seconds()
        delay = min(cap, base * 2**self._retry_round)
        self._retry_round += 1
        self._resume_at = time.monotonic() + delay * random.uniform(0.5, 1.0)

    def _purge_loop(self) -> None:
        """Exactly-once: purge committed batches (and advance the checkpoint position) in order."""
        while True:
            job = self._purge_jobs.get()
            if job is None:
                return
            records, position = job
            purge = functools.partial(self._purge_checkpointed, position=position)
            try:
                if self._with_retry(purge, [r.id for r in records]):
                    self._delivered(records)
            except Exception:
                # The records stay marked; the next term's recovery purges them from the checkpoint.
                log.exception("purge_failed", records=len(records))
            finally:
                with self._cond:
                    self._pending_purges -= 1
                    self._cond.notify_all()

    def _purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        self._store.purge_checkpointed(ids, position)

    def _count_attempt(self, record: MarkedRecord, error: Exception) -> Failure:
        """This permanent failure's attempt number (from the row, or from memory)."""
        now = datetime.now(UTC)
        if self._store.tracks_attempts:
            attempts, first = record.attempts + 1, record.first_failure or now
        else:
            previous, first = self._attempts.get(record.id, (0, now))
            attempts = previous + 1
            self._attempts[record.id] = (attempts, first)
        return Failure(record.id, record.key, reason(error), str(error)[:2000], attempts, first)

    def _release(self, record: MarkedRecord, delivered: bool, may_send: bool) -> None:
        """Lower ``record``'s key barrier and send the key's next waiting record, if any."""
        waiting = self._waiting.get(record.key)
        if not waiting:
            return
        if delivered and any(r.id == record.id for _, r in waiting):
            kept = deque(entry for entry in waiting if entry[1].id != record.id)
            self._queued -= len(waiting) - len(kept)
            waiting = self._waiting[record.key] = kept
        if waiting and may_send and self._leader_id is not None and not self._force_remark:
            self._queued -= 1
            self._send(waiting.popleft()[1])
        if not waiting:
            del self._waiting[record.key]

    def _with_retry(self, op: Callable[[Sequence[_T]], None], ids: Sequence[_T]) -> bool:
        """Run an idempotent purge/reset until it succeeds (True) or the fence refuses it (False)."""
        while ids:
            try:
                op(ids)
                return True
            except FencedError as exc:
                self._fenced(exc)
                return False
            except StoreError as exc:
                log.warning("store_retry", records=len(ids), error=str(exc))
                time.sleep(self._limits.io_error_backoff.total_seconds())
        return True

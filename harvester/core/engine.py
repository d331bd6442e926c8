"""The mark-purge/reset (MP/R) engine core: leadership terms, the fence, the mark loop, back-off
and shutdown. What happens to a marked batch is the dispatcher's (:mod:`harvester.core.dispatch`):
one per delivery mode.

The **mark thread** waits until this process leads and the dispatcher has room, marks a batch of
records under the current leader id, and hands it to the dispatcher. An empty outbox backs off
adaptively; a NOTIFY from the outbox trigger ends the wait early.

A forced remark (after a failed delivery, a lost delivery report or a fence taken back) refreshes
the leader id, so the next mark picks up everything unacknowledged, in id order.

Zombie fencing: each leadership term first bumps the store's epoch; every mark, purge and reset
is checked against it in the database. A statement refused by the fence means another process
bumped the epoch. If the elector says that process leads, leader work stops at once
(LeaderFenced) and nothing is retried; if this process still leads, the fence came from a stale
instance that finished its term start late, and the term is started again (fencing it in turn).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from contextlib import nullcontext
from typing import Protocol
from uuid import UUID, uuid4

import structlog

from harvester.core.dispatch import Context, DispatcherFactory, LeaderState, worker
from harvester.core.events import Event, LeaderAcquired, LeaderFenced, LeaderRefreshed, LeaderRevoked
from harvester.core.limits import Limits
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import (
    BatchScope,
    FailedRecords,
    FatalStoreError,
    FencedError,
    MarkSource,
    RefusedError,
    ShardCountError,
    StoreError,
)
from harvester.core.retries import PROBE, Stall, StoreRetries
from harvester.core.settle import RetryBackoff, Settler
from leader.events import LeaderEvent

log = structlog.get_logger("harvester.engine")

_LEADER_OPERATIONS = ("mark", "term_start")  # store retries the mark thread runs only while leading


class EngineStore(MarkSource, FailedRecords, Protocol):
    """The store roles the core itself uses (the dispatcher is given the ones it needs)."""


class MarkSize:
    """How many records the next mark asks for: the first size, doubled after every mark that came
    back full (a backlog) up to the largest, and the first again after one that did not."""

    def __init__(self, limits: Limits) -> None:
        self._first, self._largest = limits.mark_sizes
        self.records = self._first

    def observe(self, marked: int) -> None:
        """The last mark returned ``marked`` records."""
        self.records = min(self._largest, self.records * 2) if marked >= self.records else self._first


class Engine:
    """MP/R over a store and a dispatcher, driven by leadership events."""

    def __init__(
        self,
        store: EngineStore,
        dispatcher: DispatcherFactory,
        limits: Limits,
        metrics: HarvesterMetrics,
        emit: Callable[[Event], None],
        *,
        listen_notify: bool = True,
        still_leader: Callable[[], bool] = lambda: True,
        batch_scope: BatchScope = lambda _batch: nullcontext(),
        shard: int | None = None,
        labels: Mapping[str, object] | None = None,
        on_fatal: Callable[[Exception], None] = lambda _: None,
        outbox: str = "",  # the outbox's name, in stall reports
    ) -> None:
        self._store = store
        self._batch_scope = batch_scope
        self._on_fatal = on_fatal
        self._shard = shard or 0  # None: the outbox is not sharded (log lines carry no shard)
        self._limits = limits
        self._metrics = metrics
        self._emit = emit
        self._listen = listen_notify
        self._state = state = LeaderState(still_leader)
        self._term = 0  # bumped on every LeaderAcquired (guarded by state.cond)
        self._fenced_term = 0  # the term whose epoch the store holds (mark thread only)
        self._backoff = RetryBackoff(limits)
        self._retries = retries = StoreRetries(limits, metrics, outbox=outbox, shard=shard or 0)
        settler = Settler(store, limits, metrics, self._backoff, retries, self._fenced, lambda: state.leader_id)
        # ``labels`` (the outbox, when a reaper harvests several) and the shard go on every log line
        # of the pipeline's threads.
        bound: dict[str, object] = {**(labels or {}), **({} if shard is None else {"shard": shard})}
        self._refusal: RefusedError | None = None
        context = Context(state, limits, metrics, settler, self._backoff, self._fenced, bound, self._refused)
        self._dispatcher = dispatcher(context)
        self._threads = [worker(self._mark_loop, "harvester-mark", bound), *self._dispatcher.threads]

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Start the mark thread and the dispatcher's threads."""
        for t in self._threads:
            t.start()

    def stop_marking(self) -> None:
        """Stop marking and publishing; in-flight records still complete."""
        state = self._state
        state.stopping.set()
        with state.cond:
            state.leader_id = None
            self._dispatcher.discard_waiting()
            state.cond.notify_all()

    def drain(self, timeout: float) -> bool:
        """Wait up to ``timeout`` until no record is in flight; True if none is."""
        deadline = time.monotonic() + timeout
        with self._state.cond:
            while self._dispatcher.busy():
                left = deadline - time.monotonic()
                if left <= 0:
                    return False
                self._state.cond.wait(min(left, 0.1))
        return True

    def close(self, timeout: float) -> None:
        """Stop every thread and the publisher (after :meth:`stop_marking` and :meth:`drain`), within
        ``timeout`` in all: store retries still failing are abandoned."""
        deadline = time.monotonic() + timeout
        self.stop_marking()
        self._retries.abandon()
        self._dispatcher.close(timeout)
        for t in self._threads:
            t.join(max(0.0, deadline - time.monotonic()))

    # ------------------------------------------------------------------ state

    @property
    def alive(self) -> bool:
        """False when a worker thread died while the engine should run: a bug, which only a restart
        of the process repairs (the reaper's liveness probe reports it)."""
        return self._state.stopping.is_set() or all(t.is_alive() for t in self._threads)

    @property
    def stalled(self) -> Stall | None:
        """A store operation failing without a success for ``stall_timeout`` or longer, if any."""
        return self._retries.stalled()

    @property
    def unreachable_seconds(self) -> float:
        """How long the store's calls have failed to reach the database (0 when they do)."""
        return self._retries.unreachable_seconds()

    @property
    def leader_id(self) -> UUID | None:
        """The id records are currently marked with, or None when not leading."""
        return self._state.leader_id

    @property
    def in_flight_records(self) -> int:
        """Records published and not yet completed."""
        return self._dispatcher.in_flight_records

    @property
    def in_flight_keys(self) -> int:
        """Keys with a record in flight."""
        return self._dispatcher.in_flight_keys

    @property
    def queued_records(self) -> int:
        """Marked records waiting behind a busy key."""
        return self._dispatcher.queued_records

    def probed(self, error: StoreError | None, every: float) -> None:
        """The harvester's periodic look at the database (its backlog sample, every ``every`` seconds)
        came back, with ``error`` if it failed. A standby books it as the ``probe`` operation: it runs
        no statement of its own, and one cut from its database must stall (``/healthz``) as a leader
        does. A leader's own statements tell already."""
        if self._state.leader_id is not None or self._state.stopping.is_set():
            return
        if error is None:
            self._retries.succeeded(PROBE)
        else:
            self._retries.failed(PROBE, error, retry_in=every)

    # ------------------------------------------------------------------ leadership

    def on_leader_event(self, event: LeaderEvent) -> None:
        """Elector callback: start, stop or (for a revocation) wind down leader work."""
        state = self._state
        if isinstance(event, LeaderAcquired):
            with state.cond:
                if not state.stopping.is_set():
                    state.leader_id = event.leader_id
                    self._term += 1
                    state.force_remark = False
                    self._dispatcher.discard_waiting()
                    state.cond.notify_all()
            self._metrics.is_leader.set(1)
        elif isinstance(event, LeaderFenced):
            # Must not block: stop publishing now; records in flight still complete.
            self._lose_leadership()
            self._metrics.fenced.inc()
        elif isinstance(event, LeaderRevoked):
            self._lose_leadership()
            # The partition is released when this returns: let in-flight work finish first (unless
            # stopping: stop() already waited as long as its caller allowed).
            if not state.stopping.is_set() and not self.drain(self._limits.drain_interval.total_seconds()):
                log.warning("revoke_drain_timeout", in_flight=self.in_flight_records)
        self._emit(event)

    def _lose_leadership(self) -> None:
        with self._state.cond:
            self._state.leader_id = None
            self._dispatcher.discard_waiting()
            self._state.cond.notify_all()
        self._metrics.is_leader.set(0)
        self._retries.forget(*_LEADER_OPERATIONS)  # a standby does not retry them: nothing is stalled

    def _fenced(self, error: FencedError) -> None:
        """A newer epoch or producer fenced this process (see the module's docstring)."""
        state = self._state
        if state.still_leader() and not state.stopping.is_set():
            with state.cond:
                if state.leader_id is not None:
                    self._fenced_term = 0
                    state.force_remark = True
                    self._dispatcher.discard_waiting()
                    state.cond.notify_all()
                    self._metrics.fenced_statements.inc()
                    log.warning("fence_taken_back", error=str(error))
                    return
        with state.cond:
            leader_id, state.leader_id = state.leader_id, None
            self._dispatcher.discard_waiting()
            state.cond.notify_all()
        self._metrics.fenced_statements.inc()
        self._metrics.is_leader.set(0)
        self._retries.forget(*_LEADER_OPERATIONS)
        if leader_id is not None:
            self._metrics.fenced.inc()
            log.error("fenced_by_newer_leader", error=str(error), leader_id=str(leader_id))
            self._emit(LeaderFenced(leader_id))

    # ------------------------------------------------------------------ marking

    def _wait_for_work(self) -> tuple[int, UUID] | None:
        """Block until this process leads and the dispatcher has room; the term and leader id to
        mark under, or None to look again (stopping, or leadership lost meanwhile)."""
        state, dispatcher = self._state, self._dispatcher
        with state.cond:
            while not state.stopping.is_set() and (state.leader_id is None or not dispatcher.has_room()):
                dispatcher.check_stuck()
                if state.force_remark:
                    break
                state.cond.wait(0.1)
            dispatcher.check_stuck()
            if state.stopping.is_set() or state.leader_id is None:
                return None
            return self._term, state.leader_id

    def _mark_loop(self) -> None:
        limits, state, dispatcher = self._limits, self._state, self._dispatcher
        idle = limits.mark_backoff.total_seconds()
        size = MarkSize(limits)
        while not state.stopping.is_set():
            work = self._wait_for_work()
            if work is None:
                continue
            term, term_leader = work
            if self._fenced_term != term:
                self._begin_term(term, term_leader)
                continue
            refreshed: LeaderRefreshed | None = None
            with state.cond:
                if state.leader_id is None or self._term != term:
                    continue
                if state.force_remark:
                    dispatcher.before_remark()
                    previous, state.leader_id = state.leader_id, uuid4()
                    state.force_remark = False
                    refreshed = LeaderRefreshed(state.leader_id, previous, self._shard)
                leader_id = state.leader_id
                dispatcher.mark_started()
            if refreshed is not None:
                self._metrics.remarks.inc()
                log.info("leader_refreshed", leader_id=str(refreshed.leader_id))
                self._emit(refreshed)
            pause = self._backoff.remaining()
            if pause > 0:
                self._end_mark()
                state.stopping.wait(pause)
                continue
            started = time.perf_counter()
            try:
                batch = self._store.mark(leader_id, size.records)
            except FencedError as exc:
                self._end_mark()
                self._fenced(exc)
                continue
            except FatalStoreError as exc:
                self._end_mark()
                self._fatal(exc)
                continue
            except StoreError as exc:
                self._end_mark(remark=True)
                state.stopping.wait(self._retries.failed("mark", exc))
                continue
            self._retries.succeeded("mark")
            self._metrics.mark_seconds.observe(time.perf_counter() - started)
            size.observe(len(batch))
            if batch:
                idle = limits.mark_backoff.total_seconds()
                with self._batch_scope(batch):
                    dispatcher.dispatch(batch, leader_id)
                continue
            self._end_mark()
            self._idle_wait(idle)
            idle = min(idle * 2, limits.max_mark_backoff.total_seconds())

    def _end_mark(self, remark: bool = False) -> None:
        with self._state.cond:
            self._dispatcher.mark_ended()
            if remark:
                self._state.force_remark = True

    def _begin_term(self, term: int, leader_id: UUID) -> None:
        """Bump the fence epoch for a new term before its first mark, then let the dispatcher do
        its own term start (exactly-once: fence the previous producer, recover checkpoints)."""
        try:
            epoch = self._store.acquire(leader_id)
            with self._state.cond:
                self._state.epoch = epoch
            self._dispatcher.begin_term()
        except (FatalStoreError, RefusedError) as exc:
            self._fatal(exc)
            return
        except FencedError as exc:
            self._fenced(exc)
            return
        except StoreError as exc:
            self._state.stopping.wait(self._retries.failed("term_start", exc))
            return
        self._retries.succeeded("term_start")
        self._fenced_term = term
        self._metrics.epoch.set(epoch)
        log.info("fence_acquired", epoch=epoch, leader_id=str(leader_id))

    def _refused(self, error: RefusedError) -> None:
        """The publisher can publish nothing more (Kafka refused it what it needs): as :meth:`_fatal`,
        once, from a thread of its own, since the dispatcher calls this holding the state's lock."""
        if self._refusal is None:
            self._refusal = error
            threading.Thread(target=self._fatal, args=(error,), name="harvester-refused", daemon=True).start()

    def _fatal(self, error: FatalStoreError | RefusedError) -> None:
        """No term can be safe (reapers of the group disagree on the number of shards; a table-less
        outbox's slot was lost) or start (Kafka refuses the transactional id): stop leading and let
        the owner of the engine end the process with the reason."""
        kind = "shard_count_mismatch" if isinstance(error, ShardCountError) else "store_fatal"
        if isinstance(error, RefusedError):
            kind = "kafka_refused"
        log.error(kind, error=str(error))
        self._lose_leadership()
        self._state.stopping.set()
        self._on_fatal(error)

    def _idle_wait(self, seconds: float) -> None:
        """Back off on an empty outbox; a NOTIFY from the outbox trigger ends the wait early."""
        if not self._listen:
            self._state.stopping.wait(seconds)
            return
        try:
            self._store.wait_for_insert(seconds)
        except StoreError as exc:
            # Not a retry of its own: the next mark (booked in the store retries) tells whether the
            # database answers.
            log.warning("listen_failed", error=str(exc))
            self._state.stopping.wait(self._limits.io_error_backoff.total_seconds())

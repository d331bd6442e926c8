"""Exactly-once delivery: each marked batch and a checkpoint of its ids commit in one Kafka
transaction; a purge thread then deletes the batch and advances the checkpoint position in one
database statement, overlapping the next batch.

No per-key barrier is needed: a batch commits all or nothing, in id order, and a remark waits for
pending purges. A new term first fences the previous leader's producer (``init_transactions`` on
the shared transactional id) and purges whatever its committed checkpoints name, so nothing that
was committed to Kafka is published twice (see :mod:`harvester.kafka.transactions`).

A record that must go out alone (:attr:`harvester.core.settle.Settler.solo`: Kafka refused a batch it
shared, which aborted its transaction) gets a transaction of its own: the batch is cut around it, the
parts committed one after the other in id order, and the first that aborts ends the batch (the rest
is re-marked, so each key keeps its order and nothing is published twice).
"""

from __future__ import annotations

import functools
import queue
import threading
import time
from collections.abc import Collection, Iterator, Sequence
from uuid import UUID

import structlog

from harvester.core.dispatch import Context, Dispatcher, DispatcherFactory, worker
from harvester.core.failures import MalformedRecordError
from harvester.core.protocols import (
    CheckpointStore,
    FencedError,
    ProducerFencedError,
    StoreError,
    TransactionAbortedError,
    TransactionalPublisher,
)
from harvester.core.records import MarkedRecord

log = structlog.get_logger("harvester.engine")

# Committed batches whose purge may be pending at once; the next transaction waits beyond that.
_MAX_PENDING_PURGES = 2


class ExactlyOnceDispatcher:
    """:class:`harvester.core.dispatch.Dispatcher` over Kafka transactions and checkpoints."""

    def __init__(self, context: Context, store: CheckpointStore, transactions: TransactionalPublisher) -> None:
        self._ctx = context
        self._state = context.state
        self._store = store
        self._txn = transactions
        self._pending_purges = 0  # guarded by state.cond
        # Committed batches waiting for their purge; None tells the purge thread to exit.
        self._purge_jobs: queue.SimpleQueue[tuple[list[MarkedRecord], int] | None] = queue.SimpleQueue()
        self._threads = [worker(self._purge_loop, "harvester-complete", context.labels)]

    @property
    def threads(self) -> Sequence[threading.Thread]:
        """The purge thread."""
        return self._threads

    def close(self, timeout: float) -> None:
        """Release the producer (an open transaction is aborted by the next leader's init), then
        end the purge thread."""
        self._txn.close(timeout)
        self._purge_jobs.put_nowait(None)

    def begin_term(self) -> None:
        """Fence the previous producer and purge what its committed checkpoints name."""
        try:
            self._recover()
        except ProducerFencedError as exc:
            raise FencedError(str(exc)) from exc
        except TransactionAbortedError as exc:
            raise StoreError(str(exc)) from exc

    def _recover(self) -> None:
        metrics = self._ctx.metrics
        started = time.perf_counter()
        self._txn.init()
        ids, end = self._txn.recover(self._store.checkpoint_position())
        self._store.purge_checkpointed(ids, end)
        metrics.recoveries.inc()
        metrics.recovery_seconds.observe(time.perf_counter() - started)
        seconds = round(time.perf_counter() - started, 3)
        log.info("checkpoints_recovered", purged=len(ids), position=end, seconds=seconds)

    # ------------------------------------------------------------------ state (caller holds the lock)

    def has_room(self) -> bool:
        return True  # dispatch() itself waits for pending purges

    def busy(self) -> bool:
        return self._pending_purges > 0

    def mark_started(self) -> None:
        """Nothing to track: a batch is never published while its ids may be purged."""

    def mark_ended(self) -> None:
        """Nothing to track (see :meth:`mark_started`)."""

    def before_remark(self) -> None:
        """A pending purge's records are marked with the current id: let it finish, or the
        refreshed id would mark (and publish) them again."""
        state = self._state
        while self._pending_purges and not state.stopping.is_set():
            state.cond.wait(0.05)

    def discard_waiting(self) -> None:
        """Nothing waits outside a transaction."""

    def check_stuck(self) -> None:
        """Nothing waits behind a key."""

    in_flight_records = 0
    in_flight_keys = 0
    queued_records = 0

    # ------------------------------------------------------------------ dispatch

    def dispatch(self, batch: Sequence[MarkedRecord], leader_id: UUID) -> None:
        """Publish a whole batch in one transaction; a malformed row and the later records of its
        key wait (they are settled, then re-marked), everything else goes out now."""
        state, metrics = self._state, self._ctx.metrics
        with state.cond:
            if not state.current(leader_id) or not state.still_leader():
                return
        blocked = {r.key for r in batch if r.malformed is not None}
        good = [r for r in batch if r.key not in blocked]
        failures: list[tuple[MarkedRecord, Exception]] = [
            (r, MalformedRecordError(r.malformed)) for r in batch if r.malformed is not None
        ]
        published = 0
        for part in _parts(good, self._ctx.settler.solo):
            try:
                position = self._txn.publish_batch(part, state.epoch)
            except ProducerFencedError as exc:
                self._ctx.on_fenced(FencedError(str(exc)))
                return
            except TransactionAbortedError as exc:
                metrics.transactions_aborted.inc()
                log.warning("transaction_aborted", error=str(exc), records=len(part))
                failures += [(r, exc.failures[r.id]) for r in part if r.id in exc.failures]
                if not exc.failures:
                    self._ctx.backoff.failed()
                break
            metrics.transactions_committed.inc()
            metrics.published.inc(len(part))
            published += len(part)
            with state.cond:
                while self._pending_purges >= _MAX_PENDING_PURGES and not state.stopping.is_set():
                    state.cond.wait(0.05)
                self._pending_purges += 1
            self._purge_jobs.put_nowait((part, position))
        if failures or published < len(batch):
            self._ctx.settler.settle(failures)
            self._state.request_remark()

    # ------------------------------------------------------------------ purging

    def _purge_loop(self) -> None:
        """Purge committed batches (and advance the checkpoint position) in order."""
        settler = self._ctx.settler
        while True:
            job = self._purge_jobs.get()
            if job is None:
                return
            records, position = job
            purge = functools.partial(self._store.purge_checkpointed, position=position)
            try:
                if settler.retry("purge", purge, [r.id for r in records]):
                    settler.delivered(records)
            except Exception:
                # The records stay marked; the next term's recovery purges them from the checkpoint.
                log.exception("purge_failed", records=len(records))
            finally:
                with self._state.cond:
                    self._pending_purges -= 1
                    self._state.cond.notify_all()


def _parts(records: Sequence[MarkedRecord], solo: Collection[int]) -> Iterator[list[MarkedRecord]]:
    """``records`` in id order, as the transactions they go out in: each of those in ``solo`` alone,
    the runs between them whole."""
    if not solo or not any(r.id in solo for r in records):
        if records:
            yield list(records)
        return
    run: list[MarkedRecord] = []
    for record in records:
        if record.id in solo:
            if run:
                yield run
                run = []
            yield [record]
        else:
            run.append(record)
    if run:
        yield run


def exactly_once(store: CheckpointStore, transactions: TransactionalPublisher) -> DispatcherFactory:
    """The exactly-once mode over ``store`` and ``transactions``, as
    :class:`~harvester.core.engine.Engine` takes it."""

    def build(context: Context) -> Dispatcher:
        return ExactlyOnceDispatcher(context, store, transactions)

    return build

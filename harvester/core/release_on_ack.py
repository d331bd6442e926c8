"""At-least-once delivery whose key barriers drop at Kafka's acknowledgement, for a store whose
:attr:`~harvester.core.protocols.Purger.release_on_ack` is true (the log source).

With the barrier lowered after the purge, each key's round trip holds a database statement; here
the purges run on a thread of their own, one after another in acknowledgement order, so a key's
next record goes out as soon as the previous one was acknowledged.

What a crash repeats: a key's later record is acknowledged after its earlier one, so its purge
commits after it too, and whatever a crash leaves unpurged is, per key, its latest records. A new
leader re-reads unpurged records in their order, so it repeats them in order: a run of the key's
records, not only its last one. A key is released at the acknowledgement only while it has fewer
than :data:`~harvester.core.identity.UNPURGED_RUN` acknowledged records not purged yet, otherwise
after the purge, so the run a crash repeats is at most that long, plus the one record in flight;
:class:`harvester.client.dedup.DedupReader` remembers that many ids per key and term.
"""

from __future__ import annotations

import queue
import time

import structlog

from harvester.core.at_least_once import AtLeastOnceDispatcher
from harvester.core.dispatch import Context, worker
from harvester.core.identity import UNPURGED_RUN
from harvester.core.protocols import DeliveryReport, PublisherFactory, Purger
from harvester.core.records import MarkedRecord

log = structlog.get_logger("harvester.engine")

# Acknowledged batches one purge takes at most (records), when several wait.
_PURGE_BATCH = 20_000
# A purge of fewer records waits this long for more: off the keys' round trip, a purge mostly frees
# memory and moves the slot, so at a steady rate (acknowledgements every few milliseconds) fewer,
# larger statements cost PostgreSQL less per record.
_PURGE_GATHER = 1_000
_PURGE_GATHER_SECONDS = 0.05


class AckReleasingDispatcher(AtLeastOnceDispatcher):
    """:class:`AtLeastOnceDispatcher` that lowers a key's barrier at its record's acknowledgement
    (bounded by :data:`~harvester.core.identity.UNPURGED_RUN`) and purges on a thread of its own."""

    def __init__(self, context: Context, store: Purger, publisher: PublisherFactory) -> None:
        super().__init__(context, store, publisher)
        # Completed batches for the purge thread; None tells it to exit.
        self._purges: queue.SimpleQueue[list[DeliveryReport] | None] = queue.SimpleQueue()
        # Guarded by state.cond: acknowledged records not purged yet, in all and per key, and the
        # ids of those whose key stays busy until their purge (the key's run was full).
        self._unpurged = 0
        self._unpurged_of: dict[str, int] = {}
        self._held: set[int] = set()
        self._threads.append(worker(self._purge_loop, "harvester-purge", context.labels))

    # ------------------------------------------------------------------ state (caller holds the lock)

    def busy(self) -> bool:
        # A remark waits for the purges too: it would re-read acknowledged records not purged yet.
        return bool(self._in_flight) or self._unpurged > 0

    def _window_full(self) -> bool:
        # Acknowledged records not purged yet hold memory as in-flight ones do.
        return len(self._in_flight) + self._unpurged >= self._ctx.limits.in_flight_bound

    # ------------------------------------------------------------------ completion

    def _completions_ended(self) -> None:
        self._purges.put_nowait(None)

    def _complete(self, items: list[DeliveryReport]) -> None:
        """Lower the barriers of the acknowledged records whose key's run has room (sending their
        keys' next records) and hand the batch to the purge thread; a failed record holds its key
        until its failure is settled there, after the purges before it."""
        state, metrics = self._state, self._ctx.metrics
        may_send = state.still_leader()
        with state.cond:
            published = self._published
            for record, err in items:
                if err is not None:
                    state.force_remark = True
                    continue
                self._in_flight.pop(record.id, None)
                self._unpurged += 1
                run = self._unpurged_of.get(record.key, 0) + 1
                self._unpurged_of[record.key] = run
                if run > UNPURGED_RUN:
                    self._held.add(record.id)
                    continue
                self._busy.discard(record.key)
                if record.key in self._waiting:
                    self._release(record, delivered=True, may_send=may_send)
            metrics.in_flight.set(len(self._in_flight))
            metrics.queued.set(self._queued)
            state.cond.notify_all()
            released = self._published - published
        metrics.published.inc(released)
        self._purges.put_nowait(items)

    def _purge_loop(self) -> None:
        while True:
            first = self._purges.get()
            if first is None:
                return
            items = list(first)
            gather_until = time.monotonic() + _PURGE_GATHER_SECONDS
            while len(items) < _PURGE_BATCH:
                left = gather_until - time.monotonic() if len(items) < _PURGE_GATHER else 0.0
                try:
                    more = self._purges.get(timeout=left) if left > 0 else self._purges.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    self._purges.put_nowait(None)
                    break
                items += more
            try:
                self._purge(items)
            except Exception:
                # As in the completion thread: a remark re-publishes whatever was not purged.
                log.exception("purge_failed", records=len(items))
                with self._state.cond:
                    self._forget([r for r, err in items if err is None], may_send=False)
                self._abandon(items)

    def _purge(self, items: list[DeliveryReport]) -> None:
        """Purge the acknowledged records of ``items`` and settle the failed ones, then release the
        keys held until then."""
        state = self._state
        delivered, failures = self._purge_and_settle(items)
        may_send = state.still_leader()
        with state.cond:
            if self._purged_during_mark is not None:
                self._purged_during_mark.update(r.id for r in delivered)
            self._forget(delivered, may_send)
            for record, _ in failures:
                self._in_flight.pop(record.id, None)
                self._busy.discard(record.key)
                # After the remark the failure forced, the key's next record (its re-marked copy,
                # likely) waits behind it: sent now, as the completion thread does.
                self._release(record, delivered=False, may_send=may_send)
            self._ctx.metrics.in_flight.set(len(self._in_flight))
            self._ctx.metrics.queued.set(self._queued)
            state.cond.notify_all()

    def _forget(self, delivered: list[MarkedRecord], may_send: bool) -> None:
        """``delivered`` are purged (or abandoned): they leave their keys' runs, and a key held
        until then is released (caller holds the lock)."""
        self._unpurged -= len(delivered)
        for record in delivered:
            left = self._unpurged_of[record.key] - 1
            if left:
                self._unpurged_of[record.key] = left
            else:
                del self._unpurged_of[record.key]
            if record.id in self._held:
                self._held.discard(record.id)
                self._busy.discard(record.key)
                self._release(record, delivered=True, may_send=may_send)

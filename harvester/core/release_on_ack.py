"""At-least-once delivery whose key barriers drop at Kafka's acknowledgement, for a store whose
:attr:`~harvester.core.protocols.Purger.release_on_ack` is true (the log source).

With the barrier lowered after the purge, each key's round trip holds a database statement; here
the purges run on a thread of their own, one after another in acknowledgement order, so a key's
next record goes out as soon as the previous one was acknowledged. When the publisher keeps order
(:attr:`~harvester.core.protocols.Publisher.keeps_order`: what a partition holds of a key's records
in flight is always their first ones, in order), a key does not even wait for that: several of its
records are in flight at once, which the barrier's round trips would otherwise bound to one per key.

What a crash repeats: a key's later record is acknowledged after its earlier one, so its purge
commits after it too, and whatever a crash leaves unpurged is, per key, its latest records. A new
leader re-reads unpurged records in their order, so it repeats them in order: a run of the key's
records, not only its last one. A key has at most :data:`~harvester.core.identity.KEY_RUN` records
sent and not purged yet (in flight or acknowledged), so the run a crash repeats is at most that
long; :class:`harvester.client.dedup.DedupReader` remembers that many ids per key and term. A store
that stores a position instead of deleting rows may not cover a purged record yet (an earlier record
of another key is not done): the record is *held*, still counted in its key's run, until
:meth:`~harvester.core.protocols.Purger.durable` says the position covers it. Held records are done
for the store, which will not hand them out again, and only their ids and keys are kept, so they
count neither in the in-flight window nor as busy for a drain.

A failed record closes its key until the failure is settled, after the purges before it; a later
record of the key already in flight fails with it (the publisher keeps order) or is the key's only
one (it does not).
"""

from __future__ import annotations

import queue
import time
from collections import Counter
from collections.abc import Iterable
from operator import attrgetter

import structlog

from harvester.core.at_least_once import AtLeastOnceDispatcher
from harvester.core.dispatch import Context, worker
from harvester.core.identity import KEY_RUN
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
_KEY = attrgetter("key")


def _keys(items: list[DeliveryReport]) -> list[str]:
    return [record.key for record, _ in items]
# How often held records are looked at again while no purge comes.
_HELD_RECHECK_SECONDS = 0.5


class AckReleasingDispatcher(AtLeastOnceDispatcher):
    """:class:`AtLeastOnceDispatcher` that sends a key's next record before its previous one's purge
    (bounded by :data:`~harvester.core.identity.KEY_RUN`) and purges on a thread of its own."""

    def __init__(self, context: Context, store: Purger, publisher: PublisherFactory) -> None:
        super().__init__(context, store, publisher)
        # Records of one key in flight at once.
        self._flights = KEY_RUN if self._publisher.keeps_order else 1
        # Completed batches for the purge thread; None tells it to exit.
        self._purges: queue.SimpleQueue[list[DeliveryReport] | None] = queue.SimpleQueue()
        # Guarded by state.cond, per key: records in flight (a failed one until it is settled),
        # acknowledged records not purged yet (and their total), and failures not settled yet. A key
        # is in _busy exactly while these leave it no room (_open).
        self._flying_of: dict[str, int] = {}
        self._unpurged_of: dict[str, int] = {}
        self._unpurged = 0
        self._failing_of: dict[str, int] = {}
        # Purged records the store does not cover yet, by id: their keys (see the module's doc).
        self._held: dict[int, str] = {}
        self._threads.append(worker(self._purge_loop, "harvester-purge", context.labels))

    # ------------------------------------------------------------------ state (caller holds the lock)

    def busy(self) -> bool:
        # A drain waits for the purges too: acknowledged records not purged yet would be published
        # again by the next leader.
        return bool(self._in_flight) or self._unpurged > len(self._held)

    def _window_full(self) -> bool:
        # Acknowledged records not purged yet hold memory as in-flight ones do.
        return len(self._in_flight) + self._unpurged - len(self._held) >= self._bound

    def begin_term(self) -> None:
        """A new term streams from the stored position: what was held leaves its keys' runs (it is
        counted again if it goes out again)."""
        super().begin_term()
        with self._state.cond:
            held = list(self._held.values())
            self._held.clear()
            self._forget(held)
            self._reopen_keys(held, may_send=False)

    @property
    def in_flight_keys(self) -> int:
        return len(self._flying_of)

    def _open(self, key: str) -> bool:
        """Whether ``key`` may send its next record now."""
        flying = self._flying_of.get(key, 0)
        return (
            flying < self._flights and flying + self._unpurged_of.get(key, 0) < KEY_RUN and key not in self._failing_of
        )

    def _occupy(self, key: str) -> None:
        flying = self._flying_of.get(key, 0) + 1
        self._flying_of[key] = flying
        # Closes it as _open() would say, inlined (per record); a failing key is busy already.
        if flying >= self._flights or flying + self._unpurged_of.get(key, 0) >= KEY_RUN:
            self._busy.add(key)

    def _reopen(self, key: str, may_send: bool) -> None:
        """``key`` may have room again: send its waiting records while it has, up to a re-marked
        copy of one still in flight (dropped or sent when that one completes)."""
        while self._open(key):
            self._busy.discard(key)
            waiting = self._waiting.get(key)
            if not waiting or not may_send or waiting[0][1].id in self._in_flight:
                return
            if self._state.leader_id is None or self._state.force_remark:
                return
            self._release(waiting[0][1], delivered=False, may_send=True)  # any record of the key

    def _reopen_keys(self, keys: Iterable[str], may_send: bool) -> None:
        """:meth:`_reopen` those of ``keys`` that are closed or have records waiting."""
        for key in keys:
            if key in self._busy or key in self._waiting:
                self._reopen(key, may_send)

    @staticmethod
    def _count_down(counts: dict[str, int], key: str) -> None:
        left = counts[key] - 1
        if left:
            counts[key] = left
        else:
            del counts[key]

    # ------------------------------------------------------------------ completion

    def _completions_ended(self) -> None:
        self._purges.put_nowait(None)

    def _complete(self, items: list[DeliveryReport]) -> None:
        """Count the acknowledged records as unpurged, close the keys of the failed ones, send what
        the acknowledgements made room for, and hand the batch to the purge thread."""
        state, metrics = self._state, self._ctx.metrics
        may_send = state.still_leader()
        with state.cond:
            published = self._published
            in_flight, flying, unpurged = self._in_flight, self._flying_of, self._unpurged_of
            # Counts first, sends after: if a send raises, _abandon finds every count made.
            for record, err in items:
                key = record.key
                if err is not None:
                    # Stays in flight until the purge thread settles it.
                    state.force_remark = True
                    self._failing_of[key] = self._failing_of.get(key, 0) + 1
                    self._busy.add(key)
                    continue
                in_flight.pop(record.id, None)
                left = flying[key] - 1  # _count_down, inlined: once per record
                if left:
                    flying[key] = left
                else:
                    del flying[key]
                self._unpurged += 1
                unpurged[key] = unpurged.get(key, 0) + 1
            for record, err in items:
                if err is None and record.key in self._waiting:  # a re-marked copy waits: dropped
                    self._release(record, delivered=True, may_send=False)
            self._reopen_keys(_keys(items), may_send)
            metrics.in_flight.set(len(self._in_flight))
            metrics.queued.set(self._queued)
            state.cond.notify_all()
            released = self._published - published
        metrics.published.inc(released)
        self._purges.put_nowait(items)

    def _abandon(self, items: list[DeliveryReport]) -> None:
        """As the purge would, but without purging or sending: force a remark instead."""
        with self._state.cond:
            self._forget([r.key for r, err in items if err is None])
            self._settle([(r, err) for r, err in items if err is not None])
            self._reopen_keys(_keys(items), may_send=False)
            self._state.force_remark = True
            self._state.cond.notify_all()

    def _purge_loop(self) -> None:
        while True:
            try:
                # While records are held, the position may come to cover them without a purge of
                # this thread (the mark thread stores it when a completion's confirmation failed).
                first = self._purges.get(timeout=_HELD_RECHECK_SECONDS if self._held else None)
            except queue.Empty:
                self._purged([], [], [])
                continue
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
                delivered, failures = self._purge_and_settle(items)
            except Exception:
                # As in the completion thread: a remark re-publishes whatever was not purged.
                log.exception("purge_failed", records=len(items))
                self._abandon(items)
                continue
            self._purged(items, delivered, failures)

    def _purged(
        self, items: list[DeliveryReport], delivered: list[MarkedRecord], failures: list[tuple[MarkedRecord, Exception]]
    ) -> None:
        """The acknowledged records of ``items`` are purged and the failed ones settled: send what
        that made room for; after the remark a failure forced, a key's next record is likely its
        re-marked copy."""
        state = self._state
        may_send = state.still_leader()
        covered = self._store.durable([r.id for r in delivered])
        with state.cond:
            if self._purged_during_mark is not None:
                self._purged_during_mark.update(r.id for r in delivered)
            earlier: list[str] = []
            if len(covered) == len(delivered) and not self._held:  # a purge that deletes, say
                self._forget(list(map(_KEY, delivered)))
            else:
                durable = set(covered)
                self._held.update((r.id, r.key) for r in delivered if r.id not in durable)
                earlier = [self._held.pop(rid) for rid in covered if rid in self._held]
                self._forget([r.key for r in delivered if r.id in durable] + earlier)
            self._settle(failures)
            self._reopen_keys(_keys(items), may_send)
            if earlier:
                self._reopen_keys(earlier, may_send)
            self._ctx.metrics.in_flight.set(len(self._in_flight))
            self._ctx.metrics.queued.set(self._queued)
            state.cond.notify_all()

    def _forget(self, keys: list[str]) -> None:
        """Records of ``keys`` (one per record) are purged and covered, or abandoned: they leave their
        keys' runs (caller holds the lock)."""
        self._unpurged -= len(keys)
        unpurged = self._unpurged_of
        # Counted per key first, in C: a purge covers thousands of records of far fewer keys.
        for key, n in Counter(keys).items():
            left = unpurged[key] - n
            if left:
                unpurged[key] = left
            else:
                del unpurged[key]

    def _settle(self, failures: list[tuple[MarkedRecord, Exception]]) -> None:
        """``failures`` are settled (or abandoned): they leave flight and stop closing their keys
        (caller holds the lock)."""
        for record, _ in failures:
            if self._in_flight.pop(record.id, None) is not None:
                self._count_down(self._flying_of, record.key)
            self._count_down(self._failing_of, record.key)

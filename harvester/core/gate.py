"""The at-least-once dispatcher's per-key gate: which marked record may go out now, which waits in
its key's FIFO, and how much of the in-flight window the records sent hold.

A record sent is *in flight* until Kafka answers. Acknowledged, it is *unpurged* until its purge
commits and the store says a new leader would not publish it again
(:meth:`~harvester.core.protocols.Purger.durable`); purged but not covered yet, it is *held*, still
unpurged. Failed, it stays in flight, *failing*, until the failure is settled (reset, counted or
dead-lettered). A record is *done* when it is covered or settled, or *abandoned* when its completion
raised (a remark publishes it again).

When a record gives its key's room back is the :class:`ReleasePolicy`, chosen at build time:

- :data:`RELEASE_AT_PURGE` (mark-purge/reset with ``keyRelease: purged``, goharvest's): one
  record of a key sent and not done at most. The key's next record goes out after its previous one's
  purge committed (or its failure was settled), so a re-publish after a crash can repeat a key's
  last record but never reorder it.
- :func:`release_at_ack` (a store whose :attr:`~harvester.core.protocols.Purger.release_on_ack` is
  true: the log source, and mark-purge/reset by default, ``keyRelease: acknowledged``): a key's
  next record goes out at its previous one's acknowledgement, and when the publisher keeps order
  (:attr:`~harvester.core.protocols.Publisher.keeps_order`: what a partition holds of a key's
  records in flight is always their first ones, in order) several are in flight at once. A key's
  later record is acknowledged after its earlier one, so its purge commits after it too, and
  whatever a crash leaves unpurged is, per key, its latest records; a new leader re-reads them in
  their order, so it repeats them in order: a run of the key's records. A key has at most
  :data:`~harvester.core.identity.KEY_RUN` records sent and not done, so the run a crash repeats is
  at most that long (:class:`harvester.client.dedup.DedupReader` remembers that many ids per key and
  term). A held record counts in its key's run until the store's position covers it, but neither in
  the in-flight window nor as busy for a drain: the store will not hand it out again, and only its
  id and key are kept.

Under both, a failure closes its key until it is settled: a later record of the key in flight fails
with it (the publisher keeps order) or is the key's only one (it does not). A re-marked copy of a
record in flight, or acknowledged and not purged yet, waits behind it: dropped once that one is
acknowledged or purged (or dead-lettered), sent if it fails; a remark after a failure hands out
again what the purge thread has not deleted yet, and sending that copy would publish it twice.

A record that must go out alone (:attr:`harvester.core.settle.Settler.solo`) is taken from its key's
FIFO only while nothing is in flight, and nothing after it in the same :meth:`KeyGate.take`; its key
is *parked* until then, for the dispatcher to try again.
"""

from __future__ import annotations

from collections import Counter, deque
from collections.abc import Collection, Iterable, Sequence
from dataclasses import dataclass

from harvester.core.identity import KEY_RUN
from harvester.core.protocols import DeliveryReport
from harvester.core.records import MarkedRecord


@dataclass(frozen=True, slots=True)
class ReleasePolicy:
    """When a key has room for its next record: fewer than ``flights`` of its records in flight,
    fewer than ``run`` sent and not done (in flight or unpurged), and no failure unsettled."""

    flights: int
    run: int

    def has_room(self, flying: int, unpurged: int, failing: int) -> bool:
        """Whether a key with these counts may send its next record."""
        return flying < self.flights and flying + unpurged < self.run and not failing

    @property
    def releases_at_ack(self) -> bool:
        """Whether a key may send while an acknowledged record of it is not purged yet (else an
        acknowledgement alone never gives room back)."""
        return self.run > 1


RELEASE_AT_PURGE = ReleasePolicy(flights=1, run=1)


def release_at_ack(keeps_order: bool) -> ReleasePolicy:
    """Room at the acknowledgement, within a run of :data:`~harvester.core.identity.KEY_RUN`
    unpurged records; several of a key in flight when the publisher keeps order."""
    return ReleasePolicy(flights=KEY_RUN if keeps_order else 1, run=KEY_RUN)


class KeyGate:
    """Per-key FIFOs and counts of the records sent and not done. Not thread-safe: every method runs
    under the dispatcher's lock (``state.cond``).

    The invariant, true when each method returns:

    - ``_flying[k]`` is the number of ``k``'s records in ``_in_flight`` (failing ones included),
      ``_failing[k]`` of its failed records not settled, ``_unpurged[k]`` of its acknowledged records
      not done (held ones included); a key whose count is zero has no entry;
      ``_unpurged_total`` is the sum of ``_unpurged``, ``_held`` names some of those records and
      ``_acked`` the others;
    - ``k`` is in ``_closed`` exactly when ``policy.has_room`` says no for its counts;
    - every FIFO in ``_waiting`` is non-empty, ``_queued`` is the sum of their lengths, and
      ``_waiting_ids[i]`` is how many times id ``i`` waits in them.

    An acknowledgement gives room back only under a policy that :attr:`~ReleasePolicy.releases_at_ack`.
    :meth:`sent` and :meth:`take` count a record in; :meth:`answered`, :meth:`done`,
    :meth:`completed`, :meth:`abandon` and :meth:`new_term` count it out, each ending with :meth:`_recheck` of the keys
    whose counts fell. ``tests/unit/test_gate.py`` checks it after random sequences of them."""

    def __init__(self, policy: ReleasePolicy) -> None:
        self.policy = policy
        self._flights, self._run = policy.flights, policy.run
        self._in_flight: dict[int, MarkedRecord] = {}
        self._flying: dict[str, int] = {}
        self._failing: dict[str, int] = {}
        self._unpurged: dict[str, int] = {}
        self._unpurged_total = 0
        # Purged records the store does not cover yet, by id: their keys.
        self._held: dict[int, str] = {}
        # Acknowledged records not purged yet: a re-marked copy of one waits for its purge.
        self._acked: set[int] = set()
        self._closed: set[str] = set()
        # Per key, the records waiting behind it with the monotonic time they were queued.
        self._waiting: dict[str, deque[tuple[float, MarkedRecord]]] = {}
        # How many times each id waits in those FIFOs: a delivered record looks for its re-marked
        # copy here instead of scanning its key's FIFO (which grows with the queue per key). A plain
        # dict: a Counter's deletion is a Python-level method, once per record sent from a FIFO.
        self._waiting_ids: dict[int, int] = {}
        self._queued = 0
        # Keys whose FIFO's head waits to go out alone (some may have lost it since: harmless).
        self._parked: set[str] = set()

    # ------------------------------------------------------------------ what the dispatcher reads

    @property
    def in_flight_records(self) -> int:
        """Records sent and not answered (failed ones until settled)."""
        return len(self._in_flight)

    @property
    def in_flight_keys(self) -> int:
        """Keys with a record in flight."""
        return len(self._flying)

    @property
    def queued_records(self) -> int:
        """Records waiting behind their keys."""
        return self._queued

    @property
    def window(self) -> int:
        """Records holding memory: in flight, or acknowledged and not purged yet (held ones are not)."""
        return len(self._in_flight) + self._unpurged_total - len(self._held)

    @property
    def holding(self) -> bool:
        """Whether purged records wait for the store's position to cover them."""
        return bool(self._held)

    def busy(self) -> bool:
        """Whether records are in flight or acknowledged and not purged: a new leader would publish
        them again, so a drain waits for them."""
        return bool(self._in_flight) or self._unpurged_total > len(self._held)

    @property
    def parked(self) -> list[str]:
        """Keys whose next record waits to go out alone."""
        return list(self._parked)

    @property
    def waiting_keys(self) -> list[str]:
        """Keys with records waiting."""
        return list(self._waiting)

    def oldest_wait(self) -> float | None:
        """When the record waiting longest was queued (monotonic), or None when none waits."""
        return min((q[0][0] for q in self._waiting.values()), default=None)

    # ------------------------------------------------------------------ records in

    def hold_back(self, record: MarkedRecord, now: float) -> bool:
        """Queue ``record`` behind its key when it may not go out now (True): the key is closed or has
        records waiting, or it is a re-marked copy of a record in flight (dropped if that one is
        acknowledged, the retry if it fails) or acknowledged (dropped at its purge)."""
        key = record.key
        if key in self._closed or key in self._waiting or record.id in self._in_flight or record.id in self._acked:
            self._waiting.setdefault(key, deque()).append((now, record))
            self._waiting_ids[record.id] = self._waiting_ids.get(record.id, 0) + 1
            self._queued += 1
            return True
        return False

    def sent(self, record: MarkedRecord) -> None:
        """``record`` goes out: it is in flight, and its key closes when that fills its room."""
        key = record.key
        self._in_flight[record.id] = record
        flying = self._flying[key] = self._flying.get(key, 0) + 1
        # policy.has_room, inlined (once per record); a failing key is closed already.
        if flying >= self._flights or flying + self._unpurged.get(key, 0) >= self._run:
            self._closed.add(key)

    def take(self, keys: Iterable[str], alone: Collection[int] = ()) -> list[MarkedRecord]:
        """The records waiting behind ``keys`` that their keys have room for now, in order, counted as
        sent (the caller sends them). A key's next record that is a re-marked copy of one still in
        flight or acknowledged stays (dropped or sent when that one is answered or purged). One
        whose id is in ``alone`` is taken only when nothing is in flight, and ends the list (else
        its key is parked)."""
        taken: list[MarkedRecord] = []
        waiting_of, closed, in_flight, acked = self._waiting, self._closed, self._in_flight, self._acked
        for key in keys:
            waiting = waiting_of.get(key)
            while (
                waiting is not None
                and key not in closed
                and waiting[0][1].id not in in_flight
                and waiting[0][1].id not in acked
            ):
                solo = bool(alone) and waiting[0][1].id in alone
                if solo:
                    if in_flight:
                        self._parked.add(key)
                        break
                    self._parked.discard(key)
                record = waiting.popleft()[1]
                self._queued -= 1
                left = self._waiting_ids.pop(record.id, 1) - 1
                if left:
                    self._waiting_ids[record.id] = left
                if not waiting:
                    del waiting_of[key]
                    waiting = None
                self.sent(record)
                taken.append(record)
                if solo:
                    return taken
        return taken

    def discard_waiting(self) -> None:
        """Forget every record waiting (a remark marks them again)."""
        self._parked.clear()
        self._waiting.clear()
        self._waiting_ids.clear()
        self._queued = 0

    # ------------------------------------------------------------------ records out

    def answered(self, items: Sequence[DeliveryReport]) -> None:
        """Kafka answered ``items``: an acknowledged record leaves flight, unpurged, and its re-marked
        copies waiting are dropped; a failed one stays in flight, failing, and closes its key."""
        in_flight, flying, unpurged, acked = self._in_flight, self._flying, self._unpurged, self._acked
        delivered = 0
        for record, err in items:
            key = record.key
            if err is not None:
                self._failing[key] = self._failing.get(key, 0) + 1
                self._closed.add(key)
                continue
            del in_flight[record.id]
            left = flying[key] - 1  # _count_down, inlined: once per record
            if left:
                flying[key] = left
            else:
                del flying[key]
            unpurged[key] = unpurged.get(key, 0) + 1
            acked.add(record.id)
            delivered += 1
            if record.id in self._waiting_ids:
                self._drop_copies(record)
        self._unpurged_total += delivered
        if self.policy.releases_at_ack:
            self._recheck(record.key for record, err in items if err is None)

    def done(
        self,
        delivered: Sequence[MarkedRecord],
        covered: Sequence[int],
        failures: Sequence[DeliveryReport],
        dead: Collection[int] = (),
    ) -> list[str]:
        """``delivered`` were purged, of which (or of those held before) the store covers ``covered``,
        and ``failures`` were settled, those in ``dead`` dead-lettered (their copies waiting are
        dropped, as are those of ``delivered``): the covered ones and the failures are done, the
        others held. The keys of held records done now (their room grew too)."""
        earlier: list[str] = []
        keys = [r.key for r in delivered]
        self._acked.difference_update([r.id for r in delivered])
        waiting_ids = self._waiting_ids
        if waiting_ids:
            for record in delivered:
                if record.id in waiting_ids:
                    self._drop_copies(record)
        if len(covered) == len(delivered) and not self._held:  # a purge that deletes, say
            self._forget(keys)
        else:
            durable = set(covered)
            # A copy of a record held already (a remark handed it out again before its purge) is
            # counted in its key's run by the first until the store covers the id: the copy leaves it.
            again = [r.key for r in delivered if r.id not in durable and r.id in self._held]
            self._held.update((r.id, r.key) for r in delivered if r.id not in durable)
            earlier = [self._held.pop(rid) for rid in covered if rid in self._held]
            self._forget([r.key for r in delivered if r.id in durable] + earlier + again)
        self._settle(failures, dead)
        self._recheck(keys + [r.key for r, _ in failures] + earlier)
        return earlier

    def completed(
        self,
        items: Sequence[DeliveryReport],
        covered: Sequence[int],
        failures: Sequence[DeliveryReport],
        dead: Collection[int] = (),
    ) -> list[str]:
        """:meth:`answered` and :meth:`done` at once, for ``items`` whose purge and settlement ran
        before the gate heard of them (``covered``, ``failures`` and ``dead`` as for :meth:`done`)."""
        delivered = [r for r, err in items if err is None]
        if len(covered) != len(delivered) or self._held:
            self.answered(items)
            return self.done(delivered, covered, failures, dead)
        in_flight, flying, waiting_ids = self._in_flight, self._flying, self._waiting_ids
        for record, err in items:
            key = record.key
            del in_flight[record.id]
            left = flying[key] - 1  # _count_down, inlined: once per record
            if left:
                flying[key] = left
            else:
                del flying[key]
            if (err is None or record.id in dead) and record.id in waiting_ids:
                self._drop_copies(record)
        self._recheck([r.key for r, _ in items])
        return []

    def abandon(self, items: Sequence[DeliveryReport]) -> None:
        """``items`` were answered but their completion failed: they are done without their purge or
        settlement (the caller forces a remark, which publishes them again)."""
        self._acked.difference_update([r.id for r, err in items if err is None])
        self._forget([r.key for r, err in items if err is None])
        failures = [(r, err) for r, err in items if err is not None]
        self._settle(failures)
        self._recheck(r.key for r, _ in items)

    def new_term(self) -> None:
        """A new term starts from the store's position: what was held leaves its keys' runs (it is
        counted again if it goes out again)."""
        held = list(self._held.values())
        self._held.clear()
        self._forget(held)
        self._recheck(held)

    # ------------------------------------------------------------------ the invariant's upkeep

    def _drop_copies(self, record: MarkedRecord) -> None:
        waiting = self._waiting[record.key]
        kept = deque(entry for entry in waiting if entry[1].id != record.id)
        self._queued -= len(waiting) - len(kept)
        del self._waiting_ids[record.id]
        if kept:
            self._waiting[record.key] = kept
        else:
            del self._waiting[record.key]

    def _forget(self, keys: list[str]) -> None:
        """Acknowledged records of ``keys`` (one per record) are done: they leave their keys' runs."""
        self._unpurged_total -= len(keys)
        unpurged = self._unpurged
        # Counted per key first, in C: a purge covers thousands of records of far fewer keys.
        for key, n in Counter(keys).items():
            left = unpurged[key] - n
            if left:
                unpurged[key] = left
            else:
                del unpurged[key]

    def _settle(self, failures: Sequence[DeliveryReport], dead: Collection[int] = ()) -> None:
        """``failures`` are settled or abandoned: they leave flight and stop closing their keys; the
        copies waiting of those in ``dead`` are dropped."""
        for record, _ in failures:
            if self._in_flight.pop(record.id, None) is not None:
                _count_down(self._flying, record.key)
            _count_down(self._failing, record.key)
            if record.id in dead and record.id in self._waiting_ids:
                self._drop_copies(record)

    def _recheck(self, keys: Iterable[str]) -> None:
        """Reopen those of ``keys`` (whose counts fell) that have room now."""
        closed, has_room = self._closed, self.policy.has_room
        if not closed:
            return
        flying, unpurged, failing = self._flying, self._unpurged, self._failing
        # The closed ones among them, found in C: a completion names thousands of keys, few closed.
        for key in closed.intersection(keys):
            if has_room(flying.get(key, 0), unpurged.get(key, 0), failing.get(key, 0)):
                closed.discard(key)


def _count_down(counts: dict[str, int], key: str) -> None:
    left = counts[key] - 1
    if left:
        counts[key] = left
    else:
        del counts[key]

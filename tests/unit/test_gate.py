"""The per-key gate under random sequences of send / ack / fail / purge / abandon / remark / new term,
with each release policy: its invariant after every step, each key's bounds, each key's records
sent in the order they were marked, a copy of a dead-lettered record never sent, and a record that
must go out alone taken only with nothing in flight, last."""

from __future__ import annotations

from collections import deque
from collections.abc import Sequence
from datetime import UTC, datetime

import pytest
from hypothesis import settings
from hypothesis import strategies as st
from hypothesis.stateful import RuleBasedStateMachine, initialize, invariant, precondition, rule

from harvester.core.gate import RELEASE_AT_PURGE, KeyGate, ReleasePolicy, release_at_ack
from harvester.core.protocols import DeliveryReport
from harvester.core.records import MarkedRecord

pytestmark = pytest.mark.unit

# The three the dispatcher builds, and shorter runs that a few steps fill.
POLICIES = [
    RELEASE_AT_PURGE,
    release_at_ack(keeps_order=False),
    release_at_ack(keeps_order=True),
    ReleasePolicy(flights=1, run=2),
    ReleasePolicy(flights=2, run=3),
]
KEYS = "ab"
CREATED = datetime(2026, 1, 1, tzinfo=UTC)


class GateMachine(RuleBasedStateMachine):
    """Drives a :class:`KeyGate` as the dispatcher does (sends only while no failure awaits its
    remark) and keeps a model of every record's stage to check the gate against."""

    gate: KeyGate
    policy: ReleasePolicy

    def __init__(self) -> None:
        super().__init__()
        self.next_id = 1
        self.records: dict[int, MarkedRecord] = {}
        self.flying: set[int] = set()  # sent, not answered (or failed and not settled)
        self.failing: set[int] = set()
        self.unpurged: set[int] = set()  # acknowledged, not done (held ones included)
        self.held: set[int] = set()
        # Per key, the ids marked and not sent, in the order the gate must send them.
        self.fifo: dict[str, deque[int]] = {k: deque() for k in KEYS}
        self.remark_due = False
        self.solo: set[int] = set()  # ids to go out alone
        self.dead: set[int] = set()  # ids dead-lettered

    @initialize(policy=st.sampled_from(POLICIES))
    def build(self, policy: ReleasePolicy) -> None:
        self.policy = policy
        self.gate = KeyGate(policy)

    # ------------------------------------------------------------------ the dispatcher's side

    def _sent(self, records: list[MarkedRecord]) -> None:
        for record in records:
            fifo = self.fifo[record.key]
            assert fifo and fifo[0] == record.id, f"{record.key}: sent {record.id}, next in order {list(fifo)}"
            fifo.popleft()
            self._fly(record)

    def _fly(self, record: MarkedRecord) -> None:
        assert record.id not in self.flying | self.unpurged and not self._of(record.key, self.failing)
        self.flying.add(record.id)

    def _send_waiting(self, keys: list[str]) -> None:
        if not self.remark_due:
            idle = not self.flying
            taken = self.gate.take(keys + self.gate.parked, self.solo)
            for at, record in enumerate(taken):
                assert record.id not in self.dead, f"{record.id} sent after it was dead-lettered"
                if record.id in self.solo:
                    assert idle and at == len(taken) - 1, f"{record.id} not sent alone"
            self._sent(taken)

    def _offer(self, record: MarkedRecord) -> None:
        if self.gate.hold_back(record, 0.0):
            self.fifo[record.key].append(record.id)
        else:
            assert not self.fifo[record.key], "a record passed records of its key waiting"
            self.gate.sent(record)
            self._fly(record)

    def _of(self, key: str, ids: set[int]) -> list[int]:
        return [i for i in ids if self.records[i].key == key]

    # ------------------------------------------------------------------ rules

    @precondition(lambda self: not self.remark_due)
    @rule(key=st.sampled_from(KEYS))
    def mark(self, key: str) -> None:
        record = MarkedRecord(self.next_id, CREATED, "t", key, b"v", [])
        self.records[record.id] = record
        self.next_id += 1
        self._offer(record)

    @precondition(lambda self: any(self.fifo.values()))
    @rule(data=st.data())
    def go_alone(self, data: st.DataObject) -> None:
        """A record waiting is to go out alone (its copy in flight failed with a shared error)."""
        self.solo.add(data.draw(st.sampled_from(sorted(i for fifo in self.fifo.values() for i in fifo))))

    @precondition(lambda self: not self.remark_due and self.flying | (self.unpurged - self.held))
    @rule(data=st.data())
    def mark_a_copy(self, data: st.DataObject) -> None:
        """A remark hands out again a record in flight, or acknowledged and not purged yet."""
        self._offer(self.records[data.draw(st.sampled_from(sorted(self.flying | (self.unpurged - self.held))))])

    @precondition(lambda self: self.flying - self.failing)
    @rule(data=st.data(), failed=st.booleans())
    def answer(self, data: st.DataObject, failed: bool) -> None:
        record = self.records[data.draw(st.sampled_from(sorted(self.flying - self.failing)))]
        self.gate.answered([(record, RuntimeError("no") if failed else None)])
        if failed:
            self.failing.add(record.id)
            self.remark_due = True
        else:
            self.flying.discard(record.id)
            self.unpurged.add(record.id)
            self.fifo[record.key] = deque(i for i in self.fifo[record.key] if i != record.id)
        self._send_waiting([record.key])

    @precondition(lambda self: self.unpurged - self.held or self.failing or self.held)
    @rule(data=st.data())
    def purge(self, data: st.DataObject) -> None:
        delivered = [self.records[i] for i in _some(data, self.unpurged - self.held)]
        candidates = sorted({r.id for r in delivered} | self.held)
        covered = sorted(_some(data, set(candidates)))
        failures = self._failures(data)
        dead = self._dead(data, failures)
        earlier = self.gate.done(delivered, covered, failures, dead)
        assert sorted(earlier) == sorted(self.records[i].key for i in covered if i in self.held)
        for r in delivered:  # purged: a copy waiting would publish it twice
            self.fifo[r.key] = deque(i for i in self.fifo[r.key] if i != r.id)
        self.held |= {r.id for r in delivered} - set(covered)
        self.held -= set(covered)
        self.unpurged -= set(covered)
        self._settled(failures)
        self._send_waiting([r.key for r in delivered] + [r.key for r, _ in failures] + earlier)

    @precondition(lambda self: self.flying - self.failing)
    @rule(data=st.data())
    def complete(self, data: st.DataObject) -> None:
        """Answered and done at once: purged (covered) or settled before the gate hears of them."""
        ids = data.draw(st.sets(st.sampled_from(sorted(self.flying - self.failing)), min_size=1))
        items: list[DeliveryReport] = [
            (self.records[i], RuntimeError("no") if data.draw(st.booleans()) else None) for i in sorted(ids)
        ]
        delivered = [r for r, err in items if err is None]
        failures = [(r, err) for r, err in items if err is not None]
        dead = self._dead(data, failures)
        self.gate.completed(items, [r.id for r in delivered], failures, dead)
        for r in delivered:
            self.flying.discard(r.id)
            self.fifo[r.key] = deque(i for i in self.fifo[r.key] if i != r.id)
        self.failing |= {r.id for r, _ in failures}
        self._settled(failures)
        self.remark_due |= bool(failures)
        self._send_waiting([r.key for r, _ in items])

    @precondition(lambda self: self.unpurged - self.held or self.failing)
    @rule(data=st.data())
    def abandon(self, data: st.DataObject) -> None:
        delivered = [self.records[i] for i in _some(data, self.unpurged - self.held)]
        failures = self._failures(data)
        self.gate.abandon([(r, None) for r in delivered] + failures)
        self.unpurged -= {r.id for r in delivered}
        self._settled(failures)
        self.remark_due = True

    @rule()
    def remark(self) -> None:
        self.gate.discard_waiting()
        for fifo in self.fifo.values():
            fifo.clear()
        self.remark_due = False

    @rule()
    def new_term(self) -> None:
        self.gate.new_term()
        self.unpurged -= self.held
        self.held.clear()

    def _dead(self, data: st.DataObject, failures: Sequence[DeliveryReport]) -> set[int]:
        """Some of ``failures``, dead-lettered: their copies waiting leave the model's FIFOs."""
        dead = _some(data, {r.id for r, _ in failures})
        for record, _ in failures:
            if record.id in dead:
                self.fifo[record.key] = deque(i for i in self.fifo[record.key] if i != record.id)
        self.dead |= dead
        return dead

    def _failures(self, data: st.DataObject) -> list[DeliveryReport]:
        return [(self.records[i], RuntimeError("no")) for i in sorted(_some(data, self.failing))]

    def _settled(self, failures: Sequence[DeliveryReport]) -> None:
        for record, _ in failures:
            self.failing.discard(record.id)
            self.flying.discard(record.id)

    # ------------------------------------------------------------------ checks, after every step

    @invariant()
    def counts_match_the_model_and_the_policy(self) -> None:
        if not hasattr(self, "gate"):
            return
        gate, policy = self.gate, self.policy
        for key in KEYS:
            flying, failing = len(self._of(key, self.flying)), len(self._of(key, self.failing))
            unpurged = len(self._of(key, self.unpurged))
            assert gate._flying.get(key, 0) == flying and gate._failing.get(key, 0) == failing
            assert gate._unpurged.get(key, 0) == unpurged
            assert (key in gate._closed) is not policy.has_room(flying, unpurged, failing)
            # The policy's bounds: never more in flight or sent and not done than it allows.
            assert flying <= policy.flights and flying + unpurged <= policy.run
        assert 0 not in gate._flying.values() and 0 not in gate._failing.values() and 0 not in gate._unpurged.values()
        assert set(gate._in_flight) == self.flying and set(gate._held) == self.held
        assert gate._acked == self.unpurged - self.held
        assert gate._unpurged_total == len(self.unpurged)
        assert gate.window == len(self.flying) + len(self.unpurged) - len(self.held)
        assert gate.busy() is bool(self.flying or self.unpurged - self.held)
        assert gate.in_flight_keys == len({self.records[i].key for i in self.flying})

    @invariant()
    def fifos_match_the_model(self) -> None:
        if not hasattr(self, "gate"):
            return
        gate = self.gate
        assert all(gate._waiting.values()), "an empty FIFO is kept"
        waiting = {k: [r.id for _, r in q] for k, q in gate._waiting.items()}
        assert waiting == {k: list(q) for k, q in self.fifo.items() if q}
        assert gate.queued_records == sum(map(len, self.fifo.values()))
        ids = [i for q in self.fifo.values() for i in q]
        assert gate._waiting_ids == {i: ids.count(i) for i in set(ids)}


def _some(data: st.DataObject, ids: set[int]) -> set[int]:
    return data.draw(st.sets(st.sampled_from(sorted(ids)))) if ids else set()


GateMachine.TestCase.settings = settings(max_examples=100, stateful_step_count=50, deadline=None)
test_gate = GateMachine.TestCase


def test_a_record_to_go_alone_waits_until_nothing_is_in_flight_and_goes_last() -> None:
    """Its key is parked while another key's record flies; taken once none does, and nothing after it."""
    gate = KeyGate(RELEASE_AT_PURGE)
    a1, a2, a3, b1 = (MarkedRecord(i, CREATED, "t", k, b"v", []) for i, k in [(1, "a"), (2, "a"), (3, "a"), (4, "b")])
    for record in (a1, b1):
        assert not gate.hold_back(record, 0.0)
        gate.sent(record)
    assert gate.hold_back(a2, 0.0) and gate.hold_back(a3, 0.0)
    gate.answered([(a1, None)])
    gate.done([a1], [a1.id], [])
    assert gate.take(["a"], {a2.id}) == [] and gate.parked == ["a"]
    gate.answered([(b1, None)])
    gate.done([b1], [b1.id], [])
    assert gate.take(["b", *gate.parked], {a2.id}) == [a2] and gate.parked == []


def test_a_copy_purged_while_its_first_is_held_leaves_no_room_taken() -> None:
    """A remark hands out again what the store has not seen purged: an acknowledged record's copy
    goes out, and is purged while the first is held (a stored position, not covering it yet). Both
    acknowledgements leave the key's run once the position covers the id: a copy counted for good
    closed the key after KEY_RUN such remarks (walsender terminations stalled a retention window)."""
    gate = KeyGate(release_at_ack(keeps_order=True))
    x = MarkedRecord(1, CREATED, "t", "a", b"v", [])
    for _ in range(2):  # the record, then its copy
        assert not gate.hold_back(x, 0.0)
        gate.sent(x)
        gate.answered([(x, None)])
        gate.done([x], [], [])
    assert gate.holding
    gate.done([], [x.id], [])
    assert not gate.busy() and not gate.holding
    assert gate.window == 0


def test_a_copy_of_an_acknowledged_record_waits_for_its_purge_and_is_dropped() -> None:
    """The remark a key's failure forces hands out again its earlier record, acknowledged and not
    purged yet: that copy waits at the head of the key's FIFO when the failure is settled and the
    key opens, and is dropped by the purge (sent, it would publish the record twice)."""
    gate = KeyGate(release_at_ack(keeps_order=True))
    c0, c1 = (MarkedRecord(i, CREATED, "t", "c", b"v", []) for i in (1, 2))
    for record in (c0, c1):
        assert not gate.hold_back(record, 0.0)
        gate.sent(record)
    gate.answered([(c0, None), (c1, RuntimeError("too large"))])
    gate.discard_waiting()  # the remark
    assert gate.hold_back(c0, 0.0) and gate.hold_back(c1, 0.0)
    gate.done([], [], [(c1, RuntimeError("too large"))])  # reset: the key opens
    assert gate.take(["c"]) == []
    gate.done([c0], [c0.id], [])
    assert gate.take(["c"]) == [c1] and gate.queued_records == 0

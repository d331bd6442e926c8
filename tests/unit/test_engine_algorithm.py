"""Edge cases of the MP/R algorithm, on an in-memory outbox and a publisher the test acknowledges
by hand (deterministic; the same paths run against PostgreSQL and Kafka in tests/engine)."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from uuid import UUID

import pytest

from harvester import Engine, Limits
from harvester.core.at_least_once import at_least_once
from harvester.core.events import Event, LeaderRefreshed
from harvester.core.exactly_once import exactly_once
from harvester.core.identity import KEY_RUN
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import DeliveryCallback, StoreError
from harvester.core.records import Failure, MarkedRecord
from tests.support.harvesters import ManualElector

pytestmark = pytest.mark.unit


class MemoryStore:
    """The outbox as a dict; mark/purge/reset with the SQL statements' semantics."""

    def __init__(self, rows: Sequence[tuple[str, str]]) -> None:
        self.rows: dict[int, list[object]] = {}
        self.lock = threading.Lock()
        for i, (key, value) in enumerate(rows, start=1):
            self.rows[i] = [key, value, None]

    def acquire(self, leader_id: UUID) -> int:
        return 1

    tracks_attempts = True
    release_on_ack = False

    def fail(self, failures: Sequence[Failure]) -> None:
        self.reset([f.id for f in failures])

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        self.purge([f.id for f in failures])

    def mark(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        with self.lock:
            ids = sorted(i for i, r in self.rows.items() if r[2] != leader_id)[:limit]
            out = []
            for i in ids:
                self.rows[i][2] = leader_id
                key, value = str(self.rows[i][0]), str(self.rows[i][1])
                out.append(MarkedRecord(i, datetime.now(UTC), "t", key, value.encode(), []))
            return out

    def purge(self, ids: Sequence[int]) -> None:
        with self.lock:
            for i in ids:
                self.rows.pop(i, None)

    def durable(self, ids: Sequence[int]) -> list[int]:
        return list(ids)

    def reset(self, ids: Sequence[int]) -> None:
        with self.lock:
            for i in ids:
                if i in self.rows:
                    self.rows[i][2] = None

    def wait_for_insert(self, timeout: float) -> bool:
        time.sleep(min(timeout, 0.01))
        return False

    def close(self) -> None:
        pass


class HandPublisher:
    """Records what was published; the test decides when and how each delivery completes."""

    def __init__(self, callback: DeliveryCallback, keeps_order: bool = False) -> None:
        self.keeps_order = keeps_order
        self.callback = callback
        self.sent: list[MarkedRecord] = []
        self.lock = threading.Lock()

    def publish(self, records: Sequence[MarkedRecord]) -> None:
        with self.lock:
            self.sent.extend(records)

    def begin_term(self) -> None:
        pass

    def values(self) -> list[str]:
        with self.lock:
            return [(r.value or b"").decode() for r in self.sent]

    def close(self, timeout: float) -> None:
        pass


def wait_for(predicate: Callable[[], bool], timeout: float = 5.0) -> None:
    deadline = time.monotonic() + timeout
    while not predicate():
        assert time.monotonic() < deadline, "condition not reached"
        time.sleep(0.005)


def build(
    rows: Sequence[tuple[str, str]], release_on_ack: bool = False, **limits: object
) -> tuple[Engine, MemoryStore, HandPublisher, list[Event]]:
    store = MemoryStore(rows)
    store.release_on_ack = release_on_ack
    made: list[HandPublisher] = []
    events: list[Event] = []

    def factory(cb: DeliveryCallback) -> HandPublisher:
        made.append(HandPublisher(cb))
        return made[0]

    mode = at_least_once(store, factory)
    engine = Engine(store, mode, Limits(**limits), HarvesterMetrics(), events.append, listen_notify=False)  # type: ignore[arg-type]
    engine.start()
    return engine, store, made[0], events


class Acker:
    """Acknowledges each published record exactly once, in publish order."""

    def __init__(self, pub: HandPublisher) -> None:
        self.pub = pub
        self.done = 0

    def ack_next(self, error: Exception | None = None) -> MarkedRecord:
        wait_for(lambda: len(self.pub.sent) > self.done)
        record = self.pub.sent[self.done]
        self.done += 1
        self.pub.callback((record, error))
        return record


# Both ways a key's barrier may drop: after the purge (mark-purge) and at the acknowledgement (log).
ON_ACK = pytest.mark.parametrize("release_on_ack", [False, True], ids=["after_purge", "on_ack"])


class GatedStore(MemoryStore):
    """Purges wait until ``gate`` opens, and are logged in the order they commit."""

    def __init__(self, rows: Sequence[tuple[str, str]]) -> None:
        super().__init__(rows)
        self.gate = threading.Event()
        self.purged: list[int] = []

    def purge(self, ids: Sequence[int]) -> None:
        self.gate.wait(10)
        super().purge(ids)
        self.purged += ids


def leading(store: MemoryStore, keeps_order: bool = False) -> tuple[Engine, list[HandPublisher]]:
    """An engine over ``store`` that leads, and the publisher it makes (in a list, once made)."""
    made: list[HandPublisher] = []

    def factory(cb: DeliveryCallback) -> HandPublisher:
        made.append(HandPublisher(cb, keeps_order))
        return made[0]

    engine = Engine(
        store, at_least_once(store, factory), Limits(), HarvesterMetrics(), lambda e: None, listen_notify=False
    )
    engine.start()
    ManualElector().start(engine.on_leader_event)
    return engine, made


@pytest.mark.parametrize("release_on_ack", [False, True])
def test_a_key_is_released_at_the_ack_only_when_the_store_allows_it(release_on_ack: bool) -> None:
    store = GatedStore([("a", "a0"), ("a", "a1"), ("b", "b0")])
    store.release_on_ack = release_on_ack
    engine, made = leading(store)
    wait_for(lambda: len(made) == 1 and len(made[0].sent) == 2)
    acker = Acker(made[0])
    acker.ack_next()  # a0, whose purge waits at the gate
    time.sleep(0.2)
    assert made[0].values() == (["a0", "b0", "a1"] if release_on_ack else ["a0", "b0"])
    assert not engine.drain(0.1)  # an acknowledged record not purged yet still counts
    store.gate.set()
    wait_for(lambda: len(made[0].sent) == 3)
    acker.ack_next()  # b0
    acker.ack_next()  # a1
    assert engine.drain(5)
    assert store.purged == [1, 3, 2]  # in acknowledgement order: a key's later record purges after
    engine.close(1)


# One record of a key in flight at once, or several when the publisher keeps order.
KEEPS_ORDER = pytest.mark.parametrize("keeps_order", [False, True], ids=["one_in_flight", "in_order"])


@KEEPS_ORDER
def test_a_key_released_at_the_ack_leaves_at_most_a_bounded_run_unpurged(keeps_order: bool) -> None:
    # What a crash repeats of a key is its records sent and not purged yet: DedupReader recognises a
    # repeated run only up to its depth.
    rows = [("a", f"a{i}") for i in range(KEY_RUN + 2)]
    store = GatedStore(rows)
    store.release_on_ack = True
    engine, made = leading(store, keeps_order)
    wait_for(lambda: len(made) == 1 and len(made[0].sent) == (KEY_RUN if keeps_order else 1))
    time.sleep(0.1)
    assert len(made[0].sent) == (KEY_RUN if keeps_order else 1)  # in flight at once
    acker = Acker(made[0])
    for _ in range(KEY_RUN):  # every purge waits at the gate
        acker.ack_next()
    time.sleep(0.2)
    # The run is full: the key's next record waits for a purge instead of going out.
    assert made[0].values() == [f"a{i}" for i in range(KEY_RUN)]
    store.gate.set()
    acker.ack_next()
    acker.ack_next()
    assert engine.drain(5)
    assert store.purged == list(range(1, len(rows) + 1))
    engine.close(1)


def test_a_failure_closes_a_key_with_several_in_flight_until_it_is_settled() -> None:
    # An order-keeping publisher fails a key's later records in flight with the earlier one; the
    # re-marked copies go out after the failures are settled, in order, each once.
    store = GatedStore([("b", "b0"), ("a", "a0"), ("a", "a1"), ("a", "a2")])
    store.release_on_ack = True
    store.gate.set()
    engine, made = leading(store, keeps_order=True)
    wait_for(lambda: len(made) == 1 and len(made[0].sent) == 4)
    pub = made[0]
    acker = Acker(pub)
    acker.ack_next()  # b0
    wait_for(lambda: 1 not in store.rows)
    for _ in range(3):
        acker.ack_next(RuntimeError("broker said no"))  # a0, a1, a2
    wait_for(lambda: len(pub.sent) == 7)
    time.sleep(0.1)
    assert pub.values() == ["b0", "a0", "a1", "a2", "a0", "a1", "a2"]
    for _ in range(3):
        acker.ack_next()
    assert engine.drain(5)
    assert not store.rows
    assert len(pub.sent) == 7
    engine.close(1)


@ON_ACK
def test_busy_key_waits_while_other_keys_flow(release_on_ack: bool) -> None:
    engine, _, pub, _ = build(
        release_on_ack=release_on_ack,
        rows=[("a", "a0"), ("a", "a1"), ("b", "b0"), ("c", "c0"), ("a", "a2"), ("d", "d0")],
    )
    elector = ManualElector()
    elector.start(engine.on_leader_event)
    wait_for(lambda: len(pub.sent) == 4)
    assert pub.values() == ["a0", "b0", "c0", "d0"]  # a1, a2 wait behind a0; nothing else does
    assert engine.queued_records == 2
    acker = Acker(pub)
    acker.ack_next()  # a0 delivered: a1 follows at once
    wait_for(lambda: len(pub.sent) == 5)
    assert pub.values()[-1] == "a1"
    engine.close(1)


@ON_ACK
def test_throttle_bounds_in_flight_records(release_on_ack: bool) -> None:
    engine, store, pub, _ = build(
        release_on_ack=release_on_ack, rows=[(f"k{i}", f"v{i}") for i in range(50)], max_in_flight_records=7
    )
    ManualElector().start(engine.on_leader_event)
    acker = Acker(pub)
    peak = 0
    while acker.done < 50:
        wait_for(lambda: len(pub.sent) > acker.done)
        peak = max(peak, len(pub.sent) - acker.done)
        acker.ack_next()
    assert peak == 7
    wait_for(lambda: not store.rows)
    engine.close(1)


@ON_ACK
def test_each_published_record_counts_once_while_the_window_is_full(release_on_ack: bool) -> None:
    """The dispatcher waits for the window while the completion thread sends what a key held back
    (a1): each record is counted once in ``harvester_records_published``."""
    rows = [("a", "a0"), ("a", "a1"), ("b", "b0"), ("c", "c0"), ("d", "d0")]
    engine, store, pub, _ = build(release_on_ack=release_on_ack, rows=rows, max_in_flight_records=2)
    ManualElector().start(engine.on_leader_event)
    acker = Acker(pub)
    while acker.done < len(rows):
        acker.ack_next()
    wait_for(lambda: not store.rows)
    assert sorted(pub.values()) == sorted(value for _, value in rows)
    assert engine._metrics.published._value.get() == len(rows)
    engine.close(1)


@ON_ACK
def test_failed_delivery_forces_remark_and_keeps_key_order(release_on_ack: bool) -> None:
    engine, store, pub, events = build(release_on_ack=release_on_ack, rows=[("a", "a0"), ("a", "a1"), ("b", "b0")])
    ManualElector().start(engine.on_leader_event)
    wait_for(lambda: len(pub.sent) == 2)
    acker = Acker(pub)
    acker.ack_next(RuntimeError("broker said no"))  # a0 fails
    wait_for(lambda: any(isinstance(e, LeaderRefreshed) for e in events))
    # After the refresh a0 is marked and sent again before a1; b0 (in flight) is not duplicated.
    wait_for(lambda: len(pub.sent) == 3)
    assert pub.values() == ["a0", "b0", "a0"]
    acker.ack_next()  # b0
    acker.ack_next()  # a0 again, delivered
    wait_for(lambda: len(pub.sent) == 4)
    assert pub.values()[-1] == "a1"
    acker.ack_next()
    wait_for(lambda: not store.rows)
    assert pub.values().count("b0") == 1
    engine.close(1)


@ON_ACK
def test_fenced_leader_publishes_nothing_more(release_on_ack: bool) -> None:
    engine, store, pub, _ = build(
        release_on_ack=release_on_ack, rows=[("a", "a0"), ("a", "a1"), ("b", "b0")], mark_query_records=10
    )
    elector = ManualElector()
    elector.start(engine.on_leader_event)
    wait_for(lambda: len(pub.sent) == 2)
    elector.fence()
    acker = Acker(pub)
    acker.ack_next()
    acker.ack_next()
    time.sleep(0.2)
    assert pub.values() == ["a0", "b0"]  # a1 was queued behind a0 and is dropped at the fence
    assert list(store.rows) == [2]  # and stays in the outbox for the next leader
    engine.close(1)


def test_record_queued_past_queue_timeout_forces_a_remark() -> None:
    engine, _, pub, events = build([("a", "a0"), ("a", "a1"), ("b", "b0")], queue_timeout="50ms")
    ManualElector().start(engine.on_leader_event)
    wait_for(lambda: any(isinstance(e, LeaderRefreshed) for e in events))  # a0 is never acknowledged
    assert pub.values()[:2] == ["a0", "b0"] and "a1" not in pub.values()  # order still holds
    engine.close(1)


class FlakyCheckpointStore(MemoryStore):
    """Exactly-once purges fail once with a database error, as when PostgreSQL restarts."""

    def __init__(self, rows: Sequence[tuple[str, str]]) -> None:
        super().__init__(rows)
        self.failures_left = 1

    def checkpoint_position(self) -> int:
        return 0

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        if ids and self.failures_left:  # not the recovery's purge: the one after a commit
            self.failures_left -= 1
            raise StoreError("database error: 57P01")
        self.purge(ids)


class CommittingPublisher:
    """A transactional publisher that commits every batch."""

    def __init__(self) -> None:
        self.batches: list[list[str]] = []

    def init(self) -> None:
        pass

    def publish_batch(self, records: Sequence[MarkedRecord], epoch: int) -> int:
        self.batches.append([(r.value or b"").decode() for r in records])
        return len(self.batches)

    def recover(self, position: int) -> tuple[list[int], int]:
        return [], position

    def close(self, timeout: float) -> None:
        pass


def test_exactly_once_purge_error_is_retried_not_fatal() -> None:
    store = FlakyCheckpointStore([("a", "a0"), ("b", "b0"), ("a", "a1")])
    txn = CommittingPublisher()
    engine = Engine(
        store,
        exactly_once(store, txn),
        Limits(io_error_backoff=timedelta(milliseconds=10)),
        HarvesterMetrics(),
        lambda e: None,
        listen_notify=False,
    )
    engine.start()
    ManualElector().start(engine.on_leader_event)
    wait_for(lambda: not store.rows)  # the failed purge was retried, and marking went on
    assert [v for batch in txn.batches for v in batch] == ["a0", "b0", "a1"]  # each once, in order
    engine.close(1)

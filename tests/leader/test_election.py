"""NeliElector in-process against the real broker: topic handling, status, graceful close."""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Iterator

import pytest
from confluent_kafka import Consumer, Producer
from confluent_kafka.admin import AdminClient

from leader import (
    ElectorConfig,
    LeaderAcquired,
    LeaderEvent,
    LeaderFenced,
    LeaderRevoked,
    LeaderTopicError,
    NeliElector,
)
from tests.support.kafka import delete_topics
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

TIMING = {"heartbeat_interval": 0.5, "heartbeat_timeout": 2.0, "session_timeout": 3.0, "group_heartbeat_interval": 0.5}


class Recorder:
    """Collects (monotonic time, event) pairs; optionally blocks in LeaderRevoked handlers (for
    ``revoke_delay`` seconds, which a test may lower before its electors close)."""

    def __init__(self, revoke_delay: float = 0.0) -> None:
        self.events: list[tuple[float, LeaderEvent]] = []
        self.revoke_returned: float | None = None
        self.revoke_delay = revoke_delay
        self._cond = threading.Condition()

    def __call__(self, event: LeaderEvent) -> None:
        with self._cond:
            self.events.append((time.monotonic(), event))
            self._cond.notify_all()
        if isinstance(event, LeaderRevoked):
            time.sleep(self.revoke_delay)
            self.revoke_returned = time.monotonic()

    def wait(self, kind: type, timeout: float = 30.0) -> tuple[float, LeaderEvent]:
        with self._cond:
            ok = self._cond.wait_for(lambda: any(isinstance(e, kind) for _, e in self.events), timeout)
            assert ok, f"no {kind.__name__} in {self.events}"
            return next((t, e) for t, e in self.events if isinstance(e, kind))


@pytest.fixture
def group(services: Services) -> Iterator[Callable[..., NeliElector]]:
    """Factory of electors sharing one fresh group; all closed, and the topic deleted, afterwards."""
    group_id = unique("neli")
    made: list[NeliElector] = []

    def make(**fields: object) -> NeliElector:
        config = ElectorConfig.model_validate(
            {"kafka_config": services.kafka(), "group_id": group_id, **TIMING, **fields}
        )
        made.append(NeliElector(config))
        return made[-1]

    yield make
    for elector in made:
        elector.close()
    delete_topics(services.bootstrap, [f"{group_id}.neli"])


def test_missing_topic_without_creation_is_a_clear_error(group: Callable[..., NeliElector]) -> None:
    elector = group(create_topic=False)
    with pytest.raises(LeaderTopicError, match=f"{elector.config.topic}.*does not exist"):
        elector.start(Recorder())


def test_refused_topic_creation_is_a_clear_error(group: Callable[..., NeliElector]) -> None:
    # The broker refuses this name (too long); the elector must say what to do instead of hanging or polling.
    elector = group(topic="x" * 300)
    with pytest.raises(LeaderTopicError, match="could not be created"):
        elector.start(Recorder())


def test_creates_topic_leads_and_exports_status(services: Services, group: Callable[..., NeliElector]) -> None:
    elector = group()
    assert elector.status.is_leader is False
    events = Recorder()
    elector.start(events)
    _, acquired = events.wait(LeaderAcquired)
    meta = AdminClient(services.kafka()).list_topics(elector.config.topic, timeout=10)
    assert len(meta.topics[elector.config.topic].partitions) == 1
    # Several heartbeat intervals later the term is still proven by its own heartbeats.
    time.sleep(TIMING["heartbeat_timeout"] + 1.0)
    status = elector.status
    assert status.is_leader and status.leader_id == acquired.leader_id
    assert status.seconds_since_heartbeat is not None and status.seconds_since_heartbeat < 1.5
    assert [type(e) for _, e in events.events] == [LeaderAcquired]


def test_close_revokes_first_and_standby_takes_over_after_the_handler(group: Callable[..., NeliElector]) -> None:
    first, second = group(name="first"), group(name="second")
    first_events, second_events = Recorder(revoke_delay=1.5), Recorder()
    first.start(first_events)
    _, first_term = first_events.wait(LeaderAcquired)
    second.start(second_events)
    time.sleep(2.0)
    assert second.status.is_leader is False and second.status.leader_id is None
    assert second_events.events == []
    closing = time.monotonic()
    first.close()
    assert [e for _, e in first_events.events] == [first_term, LeaderRevoked(first_term.leader_id)]
    assert first.status.is_leader is False
    taken, second_term = second_events.wait(LeaderAcquired, 10.0)
    assert first_events.revoke_returned is not None
    # Partition 0 stayed with the old leader while its LeaderRevoked handler wrapped up.
    assert taken >= first_events.revoke_returned
    assert second_term.leader_id != first_term.leader_id
    print(f"handover {taken - first_events.revoke_returned:.3f} s after the handler returned")
    assert taken - closing < 1.5 + 3.0


def test_close_within_a_timeout_leaves_a_hanging_group_exit_in_the_background(
    group: Callable[..., NeliElector],
) -> None:
    """librdkafka's consumer close can wait for a pending group request up to the rebalance
    timeout: a close with a timeout returns by then, its revocation handled first."""
    elector = group(name="hanging")
    events = Recorder()
    elector.start(events)
    _, term = events.wait(LeaderAcquired)
    released = threading.Event()
    assert elector._consumer is not None
    consumer: Consumer = elector._consumer

    class Hanging:
        def __getattr__(self, name: str) -> object:
            return getattr(consumer, name)

        def close(self) -> None:
            released.wait(30)
            consumer.close()

    elector._consumer = Hanging()  # type: ignore[assignment]
    began = time.monotonic()
    elector.close(1.0)
    took = time.monotonic() - began
    released.set()
    assert [e for _, e in events.events] == [term, LeaderRevoked(term.leader_id)]
    assert 0.9 < took < 3.0, f"close took {took:.2f} s"


def test_an_owner_whose_heartbeats_never_come_back_leaves_to_another_member(
    group: Callable[..., NeliElector],
) -> None:
    """A partial failure: the leader's heartbeats stop reaching the leader topic while the coordinator
    still counts it in. Fenced, it keeps partition 0, so nobody else could lead; after twice the
    heartbeat timeout without proof it leaves the group, and the other member leads."""
    first, second = group(name="first"), group(name="second")
    first_events, second_events = Recorder(), Recorder()
    first.start(first_events)
    _, term = first_events.wait(LeaderAcquired)
    second.start(second_events)
    time.sleep(2.0)
    assert second_events.events == []
    assert first._producer is not None
    producer: Producer = first._producer

    class Dropping:
        def __getattr__(self, name: str) -> object:
            return getattr(producer, name)

        def produce(self, *args: object, **kwargs: object) -> None:
            pass  # lost on the way to the leader topic

    first._producer = Dropping()  # type: ignore[assignment]
    cut = time.monotonic()
    first_events.wait(LeaderFenced, 10.0)
    taken, second_term = second_events.wait(LeaderAcquired, 30.0)
    assert second_term.leader_id != term.leader_id
    assert [e for _, e in first_events.events] == [term, LeaderFenced(term.leader_id)]
    print(f"the other member led {taken - cut:.1f} s after the cut")

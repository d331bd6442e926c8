"""NeliElector over a leader topic of several partitions (sharded harvesting): one election per
partition, spread over the members by the group coordinator, each with its own heartbeats."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator

import pytest

from leader import (
    ElectorConfig,
    LeaderAcquired,
    LeaderEvent,
    LeaderFenced,
    LeaderRevoked,
    LeaderTopicError,
    NeliElector,
)
from tests.leader.test_election import TIMING, Recorder
from tests.support.kafka import create_topics, delete_topics
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

SHARDS = 4


@pytest.fixture
def group(services: Services) -> Iterator[Callable[..., NeliElector]]:
    """Factory of electors sharing one fresh group over a leader topic of SHARDS partitions."""
    group_id = unique("neli")
    made: list[NeliElector] = []

    def make(**fields: object) -> NeliElector:
        values = {"kafka_config": services.kafka(), "group_id": group_id, "partitions": SHARDS, **TIMING, **fields}
        made.append(NeliElector(ElectorConfig.model_validate(values)))
        return made[-1]

    yield make
    for elector in made:
        elector.close()
    delete_topics(services.bootstrap, [f"{group_id}.neli"])


def led(elector: NeliElector) -> set[int]:
    return {s for s in range(SHARDS) if elector.status_of(s).is_leader}


def wait_spread(electors: list[NeliElector], overlaps: list[int], timeout: float = 60.0) -> bool:
    """Until every shard has exactly one leader and each elector leads at least one; every sample
    on the way that shows a shard with two leaders is counted in ``overlaps``."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        sets = [led(e) for e in electors]
        counts = [sum(s in led_by for led_by in sets) for s in range(SHARDS)]
        overlaps.extend(s for s, c in enumerate(counts) if c > 1)
        if counts == [1] * SHARDS and all(sets):
            return True
        time.sleep(0.05)
    return False


def shards_of(events: Recorder, kind: type[LeaderEvent]) -> list[int]:
    return sorted(e.shard for _, e in events.events if isinstance(e, kind))


def test_partitions_are_spread_and_each_is_led_and_proven_on_its_own(group: Callable[..., NeliElector]) -> None:
    first, second = group(name="first"), group(name="second")
    first_events, second_events = Recorder(), Recorder()
    first.start(first_events)
    first_events.wait(LeaderAcquired)
    assert wait_spread([first], [])  # alone, it leads every shard
    second.start(second_events)
    overlaps: list[int] = []
    assert wait_spread([first, second], overlaps)
    assert overlaps == []
    assert len(led(first)) == len(led(second)) == 2
    # Each partition's own heartbeats keep its term alive well past the heartbeat timeout.
    time.sleep(TIMING["heartbeat_timeout"] + 1.0)
    assert len(led(first)) == len(led(second)) == 2
    assert shards_of(second_events, LeaderAcquired) == sorted(led(second))
    # The events name their shard; each term's id is its own.
    ids = [e.leader_id for _, e in first_events.events + second_events.events if isinstance(e, LeaderAcquired)]
    assert len(set(ids)) == len(ids)
    handed = sorted(led(second))
    second.close()
    assert shards_of(second_events, LeaderRevoked) == handed
    assert wait_spread([first], [])


def test_a_revocation_that_waits_keeps_the_members_other_terms(group: Callable[..., NeliElector]) -> None:
    """The listener of a revocation waits far past the heartbeat timeout (a drain finishing its
    records in flight): the shards the member keeps stay led under the same terms, never fenced."""
    first, second = group(name="first"), group(name="second")
    first_events = Recorder(revoke_delay=2.5 * TIMING["heartbeat_timeout"])
    first.start(first_events)
    first_events.wait(LeaderAcquired)
    assert wait_spread([first], [])
    second.start(Recorder())
    assert wait_spread([first, second], [])
    assert first_events.revoke_returned is not None
    kept = led(first)
    assert len(kept) == 2
    assert shards_of(first_events, LeaderFenced) == []
    terms = {e.shard: e.leader_id for _, e in first_events.events if isinstance(e, LeaderAcquired)}
    assert len(terms) == SHARDS  # acquired once each, at the start
    assert all(first.status_of(s).leader_id == terms[s] for s in kept)
    first_events.revoke_delay = 0.0  # the close after the test revokes the kept shards: no need to wait there


def test_a_third_member_takes_some_shards_without_two_leaders(group: Callable[..., NeliElector]) -> None:
    members = [group(name=f"m{i}") for i in range(3)]
    for m in members[:2]:
        m.start(Recorder())
    assert wait_spread(members[:2], [])
    before = [led(m) for m in members[:2]]
    overlaps: list[int] = []
    members[2].start(Recorder())
    assert wait_spread(members, overlaps)
    assert overlaps == []
    after = [led(m) for m in members[:2]]
    # Sticky: the members already there keep what they led, minus what the newcomer took.
    assert all(a <= b for a, b in zip(after, before, strict=True))
    assert sum(len(b) - len(a) for a, b in zip(after, before, strict=True)) == len(led(members[2]))


def test_a_leader_topic_with_another_number_of_partitions_is_refused(
    services: Services, group: Callable[..., NeliElector]
) -> None:
    topic = unique("neli")
    create_topics(services.bootstrap, [topic], partitions=2)
    try:
        with pytest.raises(LeaderTopicError, match="has 2 partitions but 4 shards need 4 partitions"):
            group(topic=topic).start(Recorder())
    finally:
        delete_topics(services.bootstrap, [topic])

"""The Fast NELI state machine, driven without Kafka."""

from __future__ import annotations

import json
from uuid import UUID, uuid4

import pytest

from leader.events import LeaderAcquired, LeaderFenced, LeaderRevoked
from leader.state import NeliState, decode_heartbeat, encode_heartbeat

pytestmark = pytest.mark.unit

TIMEOUT = 2.0


def leader_after_assignment() -> tuple[NeliState, UUID]:
    state = NeliState(TIMEOUT)
    event = state.assigned(0.0)
    assert isinstance(event, LeaderAcquired)
    return state, event.leader_id


def test_assignment_makes_leader_with_fresh_id_each_term() -> None:
    state = NeliState(TIMEOUT)
    ids = []
    for i in range(5):
        event = state.assigned(float(i))
        assert isinstance(event, LeaderAcquired)
        assert state.heartbeat_id == event.leader_id
        ids.append(event.leader_id)
        assert state.released(lost=False) == LeaderRevoked(event.leader_id)
    assert len(set(ids)) == 5


def test_ids_are_never_reused_even_if_the_factory_repeats() -> None:
    repeating = iter([UUID(int=1), UUID(int=1), UUID(int=2), UUID(int=2), UUID(int=3)])
    state = NeliState(TIMEOUT, new_id=lambda: next(repeating))
    first = state.assigned(0.0)
    state.released(lost=False)
    second = state.assigned(1.0)
    assert first == LeaderAcquired(UUID(int=1))
    assert second == LeaderAcquired(UUID(int=2))


def test_own_heartbeats_keep_the_term_alive() -> None:
    state, term = leader_after_assignment()
    for t in (1.5, 3.0, 4.5, 6.0):
        assert state.heartbeat(term, t) is False
        assert state.tick(t + 1.9) is None
    assert state.status(7.9).is_leader


def test_heartbeats_of_other_terms_are_no_proof() -> None:
    state, term = leader_after_assignment()
    state.released(lost=False)
    state.assigned(10.0)
    # The previous term's heartbeats (still in the topic) and another member's must not keep this term alive.
    assert state.heartbeat(term, 11.0) is False
    assert state.heartbeat(uuid4(), 11.5) is False
    assert state.status(12.1).is_leader is False
    assert isinstance(state.tick(12.1), LeaderFenced)


def test_fence_happens_once_and_status_reads_lost_before_the_tick() -> None:
    state, term = leader_after_assignment()
    assert state.tick(TIMEOUT) is None
    status = state.status(TIMEOUT + 0.01)
    assert (status.is_leader, status.leader_id) == (False, None)
    assert state.tick(TIMEOUT + 0.01) == LeaderFenced(term)
    assert state.tick(TIMEOUT + 5) is None
    # Nothing more to report on release either: the term already ended.
    assert state.released(lost=True) is None


def test_reacquire_needs_a_fresh_probe_heartbeat_and_confirmation() -> None:
    state, term = leader_after_assignment()
    state.tick(3.0)
    probe = state.heartbeat_id
    assert probe is not None and probe != term
    # The old term's heartbeats arriving late do not bring leadership back, nor does confirming anything else.
    assert state.heartbeat(term, 3.1) is False
    assert state.confirmed(term, 3.2) is None
    assert state.confirmed(probe, 3.2) is None  # a commit alone is no proof: the probe was not read back
    assert state.status(3.3).is_leader is False


def test_confirmation_without_a_read_back_probe_is_ignored() -> None:
    state, _ = leader_after_assignment()
    state.tick(3.0)
    stranger = uuid4()
    assert state.heartbeat(stranger, 3.1) is False
    assert state.confirmed(stranger, 3.2) is None
    assert state.status(3.3).is_leader is False


def test_probe_read_back_and_confirmed_starts_a_new_term() -> None:
    state, term = leader_after_assignment()
    state.tick(3.0)
    probe = state.heartbeat_id
    assert probe is not None
    assert state.heartbeat(probe, 3.5) is True
    event = state.confirmed(probe, 3.6)
    assert event == LeaderAcquired(probe)
    assert probe != term
    assert state.status(3.7).leader_id == probe
    assert state.status(3.7).seconds_since_heartbeat == pytest.approx(0.2)
    # The new term needs its own proof in time, like any other.
    assert state.tick(3.6 + TIMEOUT + 0.1) == LeaderFenced(probe)


def test_loss_fences_and_revocation_revokes() -> None:
    state, term = leader_after_assignment()
    assert state.released(lost=True) == LeaderFenced(term)
    assert state.heartbeat_id is None
    state2, term2 = leader_after_assignment()
    assert state2.released(lost=False) == LeaderRevoked(term2)


def test_after_release_nothing_is_published_or_acquired() -> None:
    state, _ = leader_after_assignment()
    state.tick(3.0)
    probe = state.heartbeat_id
    assert probe is not None
    state.released(lost=True)
    assert state.heartbeat_id is None
    assert state.heartbeat(probe, 3.5) is False
    assert state.confirmed(probe, 3.6) is None


def test_heartbeat_codec() -> None:
    term = uuid4()
    value = encode_heartbeat(term, 7, "member-a")
    assert json.loads(value)["seq"] == 7
    assert decode_heartbeat(value) == term
    for junk in (None, b"", b"not json", b"[]", b'{"leader_id": "x"}', b'{"format": "neli-heartbeat/1"}'):
        assert decode_heartbeat(junk) is None
    # A leader's report rides along; it cannot override the heartbeat's own fields.
    reported = json.loads(encode_heartbeat(term, 8, "member-a", {"in_flight": 42, "seq": 0}))
    assert (reported["in_flight"], reported["seq"], reported["member"]) == (42, 8, "member-a")


@pytest.mark.parametrize("how", ["deadline", "lost", "given up"])
def test_after_a_fence_a_new_assignment_also_waits_for_proof(how: str) -> None:
    state, term = leader_after_assignment()
    if how == "deadline":
        assert state.tick(3.0) == LeaderFenced(term)
        assert state.released(lost=True) is None
    elif how == "given up":  # the member stepped down (its work path failed) and left the group
        assert state.give_up() == LeaderFenced(term)
        assert state.give_up() is None
        assert state.status(0.1).is_leader is False and state.heartbeat_id is None
        assert state.released(lost=False) is None
    else:
        assert state.released(lost=True) == LeaderFenced(term)
    assert state.assigned(4.0) is None
    probe = state.heartbeat_id
    assert probe is not None and probe != term
    assert state.status(4.1).is_leader is False
    assert state.heartbeat(probe, 4.2) is True
    assert state.confirmed(probe, 4.3) == LeaderAcquired(probe)
    # Once proven, the next orderly hand-back and re-assignment is fast again.
    assert state.released(lost=False) == LeaderRevoked(probe)
    assert isinstance(state.assigned(5.0), LeaderAcquired)


def test_an_owner_counts_how_long_it_probes_without_proof() -> None:
    state, term = leader_after_assignment()
    assert state.unproven(1.0) == 0.0  # leading
    assert state.tick(3.0) == LeaderFenced(term)
    assert state.unproven(7.0) == 4.0
    probe = state.heartbeat_id
    assert probe is not None and state.heartbeat(probe, 7.5) is True
    assert isinstance(state.confirmed(probe, 8.0), LeaderAcquired)
    assert state.unproven(20.0) == 0.0  # leading again
    state.give_up()
    state.released(lost=False)
    assert state.unproven(30.0) == 0.0  # owns nothing
    assert state.assigned(31.0) is None  # fenced before: probes first
    assert state.unproven(33.0) == 2.0

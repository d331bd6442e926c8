"""The de-duplication rule on its own: exact-match drops only, and the bounds that make it complete."""

from __future__ import annotations

import base64
import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harvester.client.dedup_state import DedupState
from harvester.core.identity import Identity
from tests.dedup.model import ACTIONS, Copy, first_copies, run

pytestmark = pytest.mark.unit


def feed(state: DedupState, stream: list[Copy], producer: str = "p") -> list[Copy]:
    """The copies ``state`` keeps (does not call duplicates)."""
    return [c for c in stream if not state.observe((producer, "t", c[0].encode()), Identity(producer, c[1], c[2]))]


def test_ids_of_a_key_out_of_id_order_are_all_kept() -> None:
    # Transaction T2 (id 11) committed before T1 (id 10): "drop if id <= highest seen" would lose 10.
    stream = [("k", 11, 1), ("k", 10, 1), ("k", 12, 1)]
    assert feed(DedupState(), stream) == stream


def test_republish_after_late_lower_ids_is_dropped() -> None:
    # 21 was acknowledged but not purged; the new leader re-marks in id order: 19, 20 first, then 21.
    stream = [("k", 21, 1), ("k", 19, 2), ("k", 20, 2), ("k", 21, 2), ("k", 22, 2)]
    assert feed(DedupState(), stream) == [("k", 21, 1), ("k", 19, 2), ("k", 20, 2), ("k", 22, 2)]


def test_a_new_term_repeating_a_run_of_a_key_drops_each_repeat() -> None:
    # Log source: 10-12 were acknowledged but not deleted yet and 13 in flight when term 1 crashed;
    # term 2 streams them again, in order. Each higher id popped the lower ones off term 1's stack
    # (it holds 13 only) and its first ids are 1-4: only the recent ids know 10-12.
    evicted: list[str] = []
    earlier = [("k", i, 1) for i in range(1, 10)]
    repeated = [("k", i, 1) for i in (10, 11, 12, 13)]
    state = DedupState(depth=4, on_evict=evicted.append)
    assert feed(state, [*earlier, *repeated]) == [*earlier, *repeated]
    assert feed(state, [("k", i, 2) for i in (10, 11, 12, 13, 14)]) == [("k", 14, 2)]
    assert evicted == []  # the window of recent ids is no eviction


@settings(max_examples=300, deadline=None, database=None)
@given(
    ids=st.lists(st.integers(1, 1000), min_size=1, max_size=30, unique=True),
    crashes=st.lists(st.tuples(st.integers(0, 12), st.integers(0, 4), st.booleans()), max_size=3),
)
def test_runs_log_source_leaders_repeat_after_crashes_are_dropped(
    ids: list[int], crashes: list[tuple[int, int, bool]]
) -> None:
    """A log-source leader sends a key's records in commit order (any id order) and deletes them in
    that order; a crash leaves at most ``depth`` of the latest it sent undeleted (acknowledged ones
    and the one in flight, which may be lost), and the next term sends the key again from there."""
    depth = 4
    stream: list[Copy] = []
    start = 0  # ids[:start] are deleted
    for epoch, (sends, left, in_flight_lost) in enumerate(crashes, start=1):
        end = min(len(ids), start + sends)
        lost = int(in_flight_lost and end > start)
        stream += [("k", i, epoch) for i in ids[start : end - lost]]
        start = end - min(max(left, lost), end - start, depth)  # a lost record is not deleted
    stream += [("k", i, len(crashes) + 1) for i in ids[start:]]
    assert feed(DedupState(depth=depth, terms=4), stream) == first_copies(stream)


@pytest.mark.parametrize("landed_before_fence", [False, True])
def test_zombie_copy_after_many_newer_records_is_dropped(landed_before_fence: bool) -> None:
    # Epoch 1 is fenced with 5 still queued; epoch 2 re-publishes 5, then 20 more records of the key,
    # and only then does the zombie's copy land. A window of the last few ids would miss it.
    early = [("k", 5, 1)] if landed_before_fence else []
    newer = [("k", i, 2) for i in range(5, 26)]
    stream = [*early, *newer, ("k", 5, 1)]
    state = DedupState(depth=4)
    assert feed(state, stream) == first_copies(stream)
    assert feed(state, [("k", 5, 1), ("k", 5, 2)]) == []


def test_bounds_are_real_and_reported() -> None:
    evicted: list[str] = []
    # terms=1: the zombie's epoch is forgotten once a newer one appears, and its stale copy passes.
    state = DedupState(terms=1, on_evict=evicted.append)
    stream = [("k", 5, 1), ("k", 6, 2), ("k", 5, 1)]
    assert feed(state, stream) == stream
    assert "term" in evicted
    # capacity=1: a key pushed out by another key loses its memory.
    state = DedupState(capacity=1, on_evict=evicted.append)
    assert feed(state, [("a", 1, 1), ("b", 2, 1), ("a", 1, 1)]) == [("a", 1, 1), ("b", 2, 1), ("a", 1, 1)]
    assert "key" in evicted
    # depth=2: a third decreasing id pushes the oldest off the stack (and out of "first" after 2).
    state = DedupState(depth=2, on_evict=evicted.append)
    feed(state, [("k", i, 1) for i in (1, 2, 30, 29, 28)])
    assert feed(state, [("k", 28, 1), ("k", 30, 1)]) == [("k", 30, 1)]
    assert "depth" in evicted


def test_producers_and_keys_are_separate_streams() -> None:
    state = DedupState()
    assert not state.observe(("p", "t", b"k"), Identity("p", 1, 1))
    assert not state.observe(("q", "t", b"k"), Identity("q", 1, 1))
    assert not state.observe(("p", "t", b"j"), Identity("p", 1, 1))
    assert not state.observe(("p", "u", None), Identity("p", 1, 1))
    assert state.observe(("p", "u", None), Identity("p", 1, 1))


# Hypothesis drives the engine model: (action, choice) steps, shrinkable.
scripts = st.lists(st.tuples(st.sampled_from(ACTIONS), st.integers(0, 1 << 16)), min_size=100, max_size=300)


@settings(max_examples=100, deadline=None, database=None)
@given(script=scripts, keys=st.integers(1, 4), cut=st.floats(0, 1))
def test_within_the_bounds_each_record_is_kept_exactly_once(
    script: list[tuple[str, int]], keys: int, cut: float
) -> None:
    """Never drops a first delivery, always drops a re-delivery, for every stream the engine can
    write within the bounds: fewer than ``depth`` late lower ids pending, no more epochs than
    ``terms``, no more keys than ``capacity`` - across a snapshot/restore at a random point."""
    stream = run(script, keys, max_pending=3, max_epochs=4)
    split = int(len(stream) * cut)
    before = DedupState(capacity=4, depth=4, terms=4)
    kept = feed(before, stream[:split])
    after = DedupState(capacity=4, depth=4, terms=4)
    after.restore(json.loads(json.dumps(before.snapshot())))
    kept += feed(after, stream[split:])
    assert kept == first_copies(stream)


@settings(max_examples=200, deadline=None, database=None)
@given(
    stream=st.lists(st.tuples(st.sampled_from(["a", "b", "c"]), st.integers(1, 30), st.integers(1, 5)), max_size=200),
    bound=st.integers(1, 3),
)
def test_any_stream_never_loses_a_first_delivery(stream: list[Copy], bound: int) -> None:
    """Whatever the order of ids and epochs, and however small the bounds, only exact re-deliveries
    are dropped. Ids are made unique across keys, as outbox ids are."""
    state = DedupState(capacity=bound, depth=bound, terms=bound)
    stream = [(k, i * 10 + "abc".index(k), e) for k, i, e in stream]
    seen: set[int] = set()
    for copy in stream:
        dropped = state.observe(("p", "t", copy[0].encode()), Identity("p", copy[1], copy[2]))
        assert not dropped or copy[1] in seen
        seen.add(copy[1])


def test_snapshot_is_compact_json_and_validated() -> None:
    state = DedupState()
    feed(state, [("k", 11, 1), ("k", 10, 1), ("k\u00e9", 3, 2)])
    snap = state.snapshot()
    assert json.loads(json.dumps(snap)) == snap
    assert len(json.dumps(snap)) < 200
    with pytest.raises(ValueError, match="version"):
        DedupState().restore({**snap, "version": 99})
    smaller = DedupState(capacity=1)
    smaller.restore(snap)
    assert len(smaller) == 1
    assert smaller.observe(("p", "t", "k\u00e9".encode()), Identity("p", 3, 2))


def test_a_version_2_snapshot_loads_without_recent_ids_and_saves_as_version_3() -> None:
    # Term 1 read 5 then 7: 5 is among its first ids only, 7 on its stack too.
    key = base64.b64encode(b"k").decode("ascii")
    v2 = {"version": 2, "producers": ["p"], "topics": ["t"], "keys": [[0, 0, key, [[1, [5, 7], [7]]]]]}
    state = DedupState()
    state.restore(json.loads(json.dumps(v2)))
    assert feed(state, [("k", 5, 2), ("k", 7, 2), ("k", 8, 2)]) == [("k", 8, 2)]
    snap = state.snapshot()
    assert snap["version"] == 3
    assert snap["keys"][0][3] == [[1, [5, 7], [7], []], [2, [5, 7, 8], [8], [5, 7, 8]]]
    smaller = DedupState(depth=1)
    smaller.restore(v2)
    assert smaller.snapshot()["keys"][0][3] == [[1, [5], [7], []]]


def test_recent_ids_survive_a_snapshot() -> None:
    # depth 2: term 1's first ids are 1 and 2, its stack holds 11, its recent ids are 10 and 11.
    state = DedupState(depth=2)
    feed(state, [("k", i, 1) for i in (1, 2, 3, 10, 11)])
    snap = json.loads(json.dumps(state.snapshot()))
    assert snap["keys"][0][3] == [[1, [1, 2], [11], [10, 11]]]
    restored = DedupState(depth=2)
    restored.restore(snap)
    assert restored.snapshot() == snap
    assert feed(restored, [("k", 10, 2), ("k", 3, 2)]) == [("k", 3, 2)]
    trimmed = DedupState(depth=1)
    trimmed.restore(snap)
    assert trimmed.snapshot()["keys"][0][3] == [[1, [1], [11], [11]]]

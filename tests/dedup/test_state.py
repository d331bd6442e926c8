"""The de-duplication rule on its own: exact-match drops only, and the bounds that make it complete."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harvester.client.dedup import DedupState
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

"""The de-duplication of the Spark drain's replayed micro-batches: many records of a key in flight at
once, each copy naming its batch and the key's record before it there (``outbox-previous``)."""

from __future__ import annotations

import json

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from harvester.client.dedup import DedupState
from harvester.core.identity import Identity, IdentityHeaders

pytestmark = pytest.mark.unit

Attempt = list[int]  # the ids of one key one attempt of a batch delivered, in order


def copies(read: list[int], delivered: list[int], epoch: int = 7, batch: int = 3) -> list[Identity]:
    """What an attempt that read ``read`` (the key's planned records still there) and delivered
    ``delivered`` (a subsequence of it) puts in Kafka."""
    before = dict(zip(read[1:], read, strict=False))
    return [Identity("p", i, epoch, batch, before.get(i)) for i in delivered]


def kept(state: DedupState, stream: list[Identity]) -> list[int]:
    return [c.id for c in stream if not state.observe(("p", "t", b"k"), c)]


def test_a_replayed_batch_deeper_than_the_stacks_is_dropped_and_the_next_batch_kept() -> None:
    batch = list(range(10, 30))  # 20 records of one key in one batch: far beyond depth 4
    state = DedupState(depth=4)
    assert kept(state, copies(batch, batch)) == batch
    assert kept(state, copies(batch, batch)) == []  # the replay
    later = list(range(30, 40))
    assert kept(state, copies(later, later, batch=4)) == later


def test_a_partly_delivered_batch_replayed_keeps_each_record_once() -> None:
    batch = list(range(1, 13))
    state = DedupState(depth=2)
    assert kept(state, copies(batch, batch[:7])) == batch[:7]
    assert kept(state, copies(batch, batch)) == batch[7:]


def test_a_record_lost_before_delivered_ones_is_kept_when_replayed() -> None:
    # The first attempt's producer failed 4 but delivered 5 and 6: the chain stops at 3, and the
    # replay's copy of 4, a first delivery, passes although an id above it was read.
    batch = [1, 2, 3, 4, 5, 6]
    state = DedupState()
    assert kept(state, copies(batch, [1, 2, 3, 5, 6])) == [1, 2, 3, 5, 6]
    assert kept(state, copies(batch, batch)) == [4]


def test_reaper_copies_without_batch_headers_follow_the_stacks() -> None:
    state = DedupState()
    assert not state.observe(("p", "t", b"k"), Identity("p", 5, 1))
    assert state.observe(("p", "t", b"k"), Identity("p", 5, 1))
    names = IdentityHeaders()
    headers: list[tuple[str, bytes | None]] = [(names.id, b"5"), (names.epoch, b"1"), (names.producer, b"p")]
    assert Identity.from_headers(headers) == Identity("p", 5, 1, None, None)
    more = [*headers, (names.batch, b"3"), (names.previous, b"4")]
    assert Identity.from_headers(more) == Identity("p", 5, 1, 3, 4)


def test_the_chain_survives_a_snapshot_and_a_version_1_snapshot_still_loads() -> None:
    batch = list(range(1, 11))
    state = DedupState(depth=1)
    kept(state, copies(batch, batch))
    restored = DedupState(depth=1)
    restored.restore(json.loads(json.dumps(state.snapshot())))
    assert kept(restored, copies(batch, batch)) == []
    old = {**state.snapshot(), "version": 1, "keys": [entry[:4] for entry in state.snapshot()["keys"]]}
    DedupState().restore(old)


@st.composite
def attempts(draw: st.DrawFn) -> tuple[list[int], list[Attempt], list[Attempt]]:
    """A key's records in a batch, and attempts, one after another: each reads the records still
    there (a newer term may purge some in between) and delivers a subsequence of them."""
    planned = sorted(draw(st.sets(st.integers(1, 60), min_size=1, max_size=25)))
    reads: list[Attempt] = []
    delivered: list[Attempt] = []
    read = planned
    for _ in range(draw(st.integers(1, 4))):
        read = [i for i in read if draw(st.booleans()) or draw(st.booleans())]  # some purged
        reads.append(read)
        delivered.append([i for i in read if draw(st.integers(0, 3))])  # some lost
    return planned, reads, delivered


@settings(max_examples=300, deadline=None, database=None)
@given(run=attempts(), depth=st.integers(1, 3))
def test_no_first_delivery_of_a_replayed_batch_is_dropped(
    run: tuple[list[int], list[Attempt], list[Attempt]], depth: int
) -> None:
    _, reads, delivered = run
    state = DedupState(depth=depth)
    seen: set[int] = set()
    for read, sent in zip(reads, delivered, strict=True):
        for copy in copies(read, sent):
            assert not state.observe(("p", "t", b"k"), copy) or copy.id in seen
            seen.add(copy.id)


@settings(max_examples=200, deadline=None, database=None)
@given(
    planned=st.lists(st.integers(1, 10_000), min_size=1, max_size=40, unique=True), cuts=st.lists(st.integers(0, 40))
)
def test_attempts_that_deliver_prefixes_pass_each_record_exactly_once(planned: list[int], cuts: list[int]) -> None:
    """A Kafka producer that stops at its first failure delivers a prefix: every replayed copy is
    dropped, whatever the depth."""
    planned.sort()
    state = DedupState(depth=1)
    out: list[int] = []
    for cut in [*cuts, len(planned)]:
        out += kept(state, copies(planned, planned[:cut]))
    assert out == planned

"""The drain's micro-batch size, from what the last batch took (an algorithm on a given clock)."""

from __future__ import annotations

from harvester.spark.drain.sizing import CYCLE, FIRST, BatchSize


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_full_batches_grow_to_the_cycle_and_stop_at_the_cap() -> None:
    clock = Clock()
    size = BatchSize(100_000, clock)
    assert size.next() == FIRST
    size.planned(FIRST, full=True)
    clock.now += 1.0  # 10,000 records a second: a cycle's worth is 50,000
    assert size.next() == int(FIRST * CYCLE)
    size.planned(size.size, full=True)
    clock.now += 1.0  # faster still: the cap
    assert size.next() == 100_000


def test_a_batch_not_full_says_nothing_and_slow_ones_never_go_below_the_first_size() -> None:
    clock = Clock()
    size = BatchSize(100_000, clock)
    size.next()
    size.planned(10, full=False)  # the outbox ran dry
    clock.now += 100.0
    assert size.next() == FIRST
    size.planned(FIRST, full=True)
    clock.now += 60.0  # slow: under the first size, which stays the floor
    assert size.next() == FIRST


def test_a_cap_below_the_first_size_is_every_batch_size() -> None:
    clock = Clock()
    size = BatchSize(100, clock)
    assert size.next() == 100
    size.planned(100, full=True)
    clock.now += 0.001
    assert size.next() == 100

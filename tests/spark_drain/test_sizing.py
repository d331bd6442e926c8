"""The drain's micro-batch size, from what the last batch took (an algorithm on a given clock)."""

from __future__ import annotations

from harvester.spark.drain.options import DrainOptions
from harvester.spark.drain.sizing import CYCLE, FIRST, MOST, BatchSize


class Clock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now


def test_full_batches_grow_to_the_cycle_and_stop_at_the_most() -> None:
    clock = Clock()
    size = BatchSize(1, clock)
    assert size.next() == FIRST
    size.planned(FIRST, full_shards=1)
    clock.now += 1.0  # 10,000 records a second: a cycle's worth is 50,000
    assert size.next() == int(FIRST * CYCLE)
    size.planned(size.size, full_shards=1)
    clock.now += 1.0  # faster still
    assert size.next() == MOST


def test_the_rate_is_the_full_shards_and_the_size_is_for_all_of_them() -> None:
    clock = Clock()
    size = BatchSize(4, clock)
    size.next()
    size.planned(2_500, full_shards=1)  # one shard of four had records: its 2,500 in a second
    clock.now += 1.0
    assert size.next() == int(2_500 * 4 * CYCLE)


def test_a_batch_not_full_says_nothing_and_slow_ones_never_go_below_the_first_size() -> None:
    clock = Clock()
    size = BatchSize(1, clock)
    size.next()
    size.planned(0, full_shards=0)  # the outbox ran dry
    clock.now += 100.0
    assert size.next() == FIRST
    size.planned(FIRST, full_shards=1)
    clock.now += 60.0  # slow (or a processing-time trigger's wait): the first size stays the floor
    assert size.next() == FIRST


def test_only_an_unset_max_records_per_trigger_is_sized() -> None:
    assert DrainOptions.parse({"dsn": "x"}).sized
    assert DrainOptions.parse({"dsn": "x"}).max_records == MOST
    fixed = DrainOptions.parse({"dsn": "x", "maxRecordsPerTrigger": "100"})
    assert (fixed.sized, fixed.max_records) == (False, 100)

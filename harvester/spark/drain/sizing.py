"""How many records the drain plans for its next micro-batch, when the query leaves
``maxRecordsPerTrigger`` unset: sized by what the last batch took.

A micro-batch costs Spark and the drain a fixed part (writing the offset, planning, purging,
scheduling the tasks: a few hundred milliseconds) beside the part that grows with its records, so
batches too small spend much of the query's time on the fixed part. The drain starts at
:data:`FIRST` records and, after each batch in which some shard had its whole share, plans the next
for about :data:`CYCLE` seconds at the rate those shards ran, between :data:`FIRST` and :data:`MOST`.
A batch in which no shard was full (the outbox ran dry) says nothing of the rate and leaves the size
as it was. The time between two plans includes a processing-time trigger's wait, which only makes
the estimate smaller: such a query stays at :data:`FIRST`. A query that sets
``maxRecordsPerTrigger`` plans that many every time.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FIRST = 10_000
"""Records of the first micro-batch, over all shards."""

MOST = 100_000
"""The most records of a sized micro-batch, over all shards."""

CYCLE = 5.0
"""Seconds one micro-batch should take, planning to planning."""


class BatchSize:
    """The next micro-batch's size over ``shards`` shards, from the time between two plans and what
    the full shards of the first one planned."""

    def __init__(self, shards: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._shards = shards
        self._clock = clock
        self.size = FIRST
        self._started = 0.0  # when the plan now being made began
        self._planned: tuple[float, float] | None = None  # the last plan's start, records per full shard

    def next(self) -> int:
        """The size for the plan now being made, from the batch planned before it (which Spark has
        run by now: it plans a batch once the one before completed)."""
        now = self._clock()
        if self._planned is not None:
            at, per_shard = self._planned
            took = now - at
            if took > 0:
                self.size = max(FIRST, min(MOST, int(per_shard * self._shards / took * CYCLE)))
        self._planned = None
        self._started = now
        return self.size

    def planned(self, records: int, full_shards: int) -> None:
        """The plan made after :meth:`next` holds ``records`` in the ``full_shards`` shards that had
        their whole share; only those measure the rate."""
        self._planned = (self._started, records / full_shards) if full_shards else None

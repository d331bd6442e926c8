"""How many records the drain plans for its next micro-batch: sized by what the last one took.

A micro-batch costs Spark and the drain a fixed part (writing the offset, planning, purging,
scheduling the tasks: a few hundred milliseconds) beside the part that grows with its records, so
batches too small spend most of the query's time on the fixed part. The drain starts at
:data:`FIRST` records (or ``maxRecordsPerTrigger``, when smaller) and, after each full batch, plans the
next for about :data:`CYCLE` seconds at the rate the last one ran, never fewer than it started with
nor more than ``maxRecordsPerTrigger``. A batch that was not full (the outbox ran dry) says nothing
of the rate and leaves the size as it was.
"""

from __future__ import annotations

import time
from collections.abc import Callable

FIRST = 10_000
"""Records of the first micro-batch, over all shards."""

CYCLE = 5.0
"""Seconds one micro-batch should take, planning to planning."""


class BatchSize:
    """The next micro-batch's size, from the time between two plans and what the first planned."""

    def __init__(self, most: int, clock: Callable[[], float] = time.monotonic) -> None:
        self._least = min(FIRST, most)
        self._most = most
        self._clock = clock
        self.size = self._least
        self._started = 0.0  # when the plan now being made began
        self._planned: tuple[float, int] | None = None  # the last plan's start and records, when full

    def next(self) -> int:
        """The size for the plan now being made, from the batch planned before it (which Spark has
        run by now: it plans a batch once the one before completed)."""
        now = self._clock()
        if self._planned is not None:
            at, records = self._planned
            took = now - at
            if took > 0:
                self.size = max(self._least, min(self._most, int(records / took * CYCLE)))
        self._planned = None
        self._started = now
        return self.size

    def planned(self, records: int, full: bool) -> None:
        """The plan made after :meth:`next` holds ``records``, and was ``full`` (a shard had more than
        its share); only a full one measures the rate."""
        self._planned = (self._started, records) if full else None

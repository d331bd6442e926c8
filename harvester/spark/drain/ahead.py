"""The next micro-batch's plan, made while the current one runs.

Spark asks a source for its next batch (``latestOffset``) only once the batch before has run, so a
plan made then is time the executors sit idle: about 0.7 s per batch of 100,000 records over one
shard (reading their ids, sizes and topics, and the dead-lettering of what Kafka would refuse), a
seventh of a drain. Once a batch's partitions are handed out, the driver plans each full shard's
next ids in a thread, skipping the ids of the batch running, exactly as the next ``latestOffset``
would; that call then takes the plan made ahead if the shard's term and the ids to skip are still
the same, trims it to the batch's size, or tops it up with what was committed since (and asks the
store either way, which is how a plan learns that a newer term took the shard).

The plan made ahead is only read: the records it names stay in the outbox until a batch that
planned them is purged, and a record whose transaction commits later is found by the next plan.
The driver's store is used by one thread at a time: every call of the reader that touches it
first waits for the plan under way (:meth:`PlanAhead.settle`).
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence
from dataclasses import dataclass

import structlog

log = structlog.get_logger("harvester.spark.drain")

Plan = Callable[[int, list[int], int], list[int]]
"""``plan(shard, skip, limit)``: the next ids of ``shard`` not in ``skip``, at most ``limit``."""


@dataclass(frozen=True, slots=True)
class Work:
    """What to plan ahead for one shard: under which term, past which ids, how many."""

    epoch: int
    skip: Sequence[int]
    limit: int


@dataclass(frozen=True, slots=True)
class _Made:
    work: Work
    ids: list[int]


class PlanAhead:
    """Plans made in one thread between a batch's partitions and the next batch's plan."""

    def __init__(self) -> None:
        self._thread: threading.Thread | None = None
        self._made: dict[int, _Made] = {}

    def start(self, work: dict[int, Work], plan: Plan) -> None:
        """Plan ``work``'s shards in a thread (after the plans made before are settled and dropped)."""
        self.settle()
        self._made = {}
        if not work:
            return

        def run() -> None:
            for shard, todo in work.items():
                try:
                    self._made[shard] = _Made(todo, plan(shard, list(todo.skip), todo.limit))
                except Exception as exc:  # the next plan plans the shard itself, and meets the error there
                    log.warning("plan_ahead_failed", shard=shard, error=str(exc))

        self._thread = threading.Thread(target=run, name="outbox-drain-plan-ahead", daemon=True)
        self._thread.start()

    def settle(self) -> None:
        """Wait for the plans under way."""
        if self._thread is not None:
            self._thread.join()
            self._thread = None

    def take(self, shard: int, epoch: int, skip: Sequence[int], limit: int, plan: Plan) -> list[int] | None:
        """The ids planned ahead for ``shard``, made fit for a plan under ``epoch`` past ``skip`` of
        at most ``limit`` ids, or None if there is none that fits (a new term, other ids to skip)."""
        self.settle()
        made = self._made.pop(shard, None)
        if made is None or made.work.epoch != epoch or list(made.work.skip) != list(skip):
            return None
        ids = made.ids[:limit]
        # What was committed since, or what a larger batch holds more. A plan of nothing still
        # answers whether the term holds, as every plan does: a fenced one raises.
        more = limit - len(ids)
        return sorted(ids + plan(shard, [*skip, *ids] if more else [], more))

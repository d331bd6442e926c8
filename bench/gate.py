"""Per-record CPU of the at-least-once dispatcher's key gate, without a database or Kafka: dispatch,
delivery report, purge bookkeeping and the key's next record, over a store whose purge does nothing
and a publisher that acknowledges at once.

    python bench/gate.py [--records 100000] [--keys 1000] [--runs 5]

Prints, per release policy (at purge; at the acknowledgement, one or several of a key in flight), the
CPU microseconds per record of the whole process, median of the runs with its range. To compare two
trees, run it with the other checkout first on ``PYTHONPATH``.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Sequence
from datetime import UTC, datetime
from uuid import UUID, uuid4

from harvester.core.at_least_once import at_least_once
from harvester.core.dispatch import Context, LeaderState
from harvester.core.limits import Limits
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import DeliveryCallback, FencedError
from harvester.core.records import Failure, MarkedRecord
from harvester.core.retries import StoreRetries
from harvester.core.settle import RetryBackoff, Settler


class NoStore:
    """Purges and settles nothing; every purge is covered at once."""

    tracks_attempts = True

    def __init__(self, release_on_ack: bool) -> None:
        self.release_on_ack = release_on_ack

    def purge(self, ids: Sequence[int]) -> None:
        pass

    def durable(self, ids: Sequence[int]) -> list[int]:
        return list(ids)

    def reset(self, ids: Sequence[int]) -> None:
        pass

    def fail(self, failures: Sequence[Failure]) -> None:
        pass

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        pass


class AckingPublisher:
    """Acknowledges every record as it is published."""

    def __init__(self, callback: DeliveryCallback, keeps_order: bool) -> None:
        self._callback = callback
        self.keeps_order = keeps_order

    def publish(self, records: Sequence[MarkedRecord]) -> None:
        for record in records:
            self._callback((record, None))

    def begin_term(self) -> None:
        pass

    def close(self, timeout: float) -> None:
        pass


def _fenced(_error: FencedError) -> None:
    pass


def cpu_per_record(release_on_ack: bool, keeps_order: bool, records: int, keys: int, batch: int = 500) -> float:
    """CPU microseconds per record of dispatching and completing ``records`` over ``keys`` keys."""
    limits, metrics = Limits(), HarvesterMetrics()
    state = LeaderState(lambda: True)
    state.leader_id = leader = uuid4()
    backoff = RetryBackoff(limits)
    store = NoStore(release_on_ack)
    settler = Settler(store, limits, metrics, backoff, StoreRetries(limits, metrics), _fenced, lambda: state.leader_id)
    context = Context(state, limits, metrics, settler, backoff, _fenced)
    dispatcher = at_least_once(store, lambda cb: AckingPublisher(cb, keeps_order))(context)
    for thread in dispatcher.threads:
        thread.start()
    created = datetime.now(UTC)
    marked = [MarkedRecord(i, created, "t", f"k{i % keys}", b"v", []) for i in range(1, records + 1)]
    started = time.process_time()
    for first in range(0, records, batch):
        with state.cond:
            dispatcher.mark_started()
            while not dispatcher.has_room():
                state.cond.wait(0.01)
        dispatcher.dispatch(marked[first : first + batch], leader)
    with state.cond:
        while dispatcher.busy() or dispatcher.queued_records:
            state.cond.wait(0.01)
    spent = time.process_time() - started
    dispatcher.close(1)
    for thread in dispatcher.threads:
        thread.join(2)
    return spent / records * 1e6


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--runs", type=int, default=5)
    args = p.parse_args()
    policies = (("at purge", False, False), ("at ack", True, False), ("at ack, in order", True, True))
    for name, on_ack, in_order in policies:
        runs = [cpu_per_record(on_ack, in_order, args.records, args.keys) for _ in range(args.runs)]
        print(
            f"{name:18} CPU {statistics.median(runs):.2f} us/record (median of {args.runs},"
            f" {min(runs):.2f} to {max(runs):.2f})"
        )


if __name__ == "__main__":
    main()

"""What happens to a record after the broker answered: delivered records are accounted for; failed
ones are reset (retriable), counted (permanent) or dead-lettered (out of attempts).

Poison records: a failure is *retriable* (the broker or network) or *permanent* (the record), see
:mod:`harvester.core.failures`. Retriable failures back off exponentially, with jitter, without
counting against the record. Permanent ones count attempts (in the table when it has the attempt
columns, else in memory); at ``max_attempts`` the record moves to the dead-letter table, which
releases its key.

A poison record does not take its neighbours with it: Kafka refuses a partition's whole batch for one
record too large, failing every record that shared the batch. A record refused with such a *shared*
error (:func:`harvester.core.failures.shared`) joins :attr:`Settler.solo`, the records the dispatchers
publish alone (nothing else in flight in at-least-once mode, a transaction of its own in
exactly-once mode), and counts an attempt only when it was refused alone; meanwhile it is reset, as
a retriable failure is, without the back-off.
"""

from __future__ import annotations

import random
import time
from collections.abc import Callable, Sequence
from datetime import UTC, datetime
from itertools import groupby
from operator import attrgetter
from typing import TYPE_CHECKING, TypeVar

import structlog

from harvester.core.failures import classify, reason, shared
from harvester.core.limits import Limits
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import FailedRecords, FencedError, StoreError
from harvester.core.records import Failure, MarkedRecord
from harvester.core.retries import StoreRetries

if TYPE_CHECKING:
    from uuid import UUID

log = structlog.get_logger("harvester.engine")

_T = TypeVar("_T")


class RetryBackoff:
    """Delays the next mark after retriable failures: exponential, capped, with jitter; the first
    delivery that succeeds ends it. Used by the mark thread and the completion side, whose updates
    are single assignments."""

    def __init__(self, limits: Limits) -> None:
        self._base = limits.retry_backoff.total_seconds()
        self._cap = limits.max_retry_backoff.total_seconds()
        self._round = 0
        self._resume_at = 0.0  # monotonic time before which no mark runs

    def failed(self) -> None:
        """Push the next mark back by one more round."""
        delay = min(self._cap, self._base * 2**self._round)
        self._round += 1
        self._resume_at = time.monotonic() + delay * random.uniform(0.5, 1.0)

    def succeeded(self) -> None:
        """Records got through: the next failure starts again from the first round."""
        self._round = 0

    def remaining(self) -> float:
        """Seconds until the next mark may run (<= 0: now)."""
        return self._resume_at - time.monotonic()


def _latencies(records: Sequence[MarkedRecord]) -> list[tuple[float, int]]:
    """Seconds from the records' create_time to now, as runs: (seconds, how many records in a row
    have that create_time). The log source's records share one per transaction."""
    now = time.time()
    return [
        (max(0.0, now - created.timestamp()), len(list(run)))
        for created, run in groupby(records, key=attrgetter("create_time"))
    ]


class Settler:
    """Books delivered and failed records in the store, retrying through database errors."""

    def __init__(
        self,
        store: FailedRecords,
        limits: Limits,
        metrics: HarvesterMetrics,
        backoff: RetryBackoff,
        retries: StoreRetries,
        on_fenced: Callable[[FencedError], None],
        leader_id: Callable[[], UUID | None],
    ) -> None:
        self._store = store
        self._limits = limits
        self._metrics = metrics
        self._backoff = backoff
        self._retries = retries
        self._on_fenced = on_fenced
        self._leader_id = leader_id
        # Attempts of permanently failing records, when the table cannot keep them (by id).
        self._attempts: dict[int, tuple[int, datetime]] = {}
        # Ids of records refused with a shared error: published alone until delivered or dead-lettered.
        # Written by the completion side, read by the dispatchers (set operations are atomic).
        self.solo: set[int] = set()

    def retry(self, operation: str, op: Callable[[Sequence[_T]], None], items: Sequence[_T]) -> bool:
        """Run an idempotent purge/reset until it succeeds (True), backing off between tries (see
        :mod:`harvester.core.retries`); False when the fence refuses it or shutdown abandons it (the
        records stay marked in the outbox for the next leader)."""
        retries = self._retries
        while items:
            try:
                op(items)
            except FencedError as exc:
                self._on_fenced(exc)
                return False
            except StoreError as exc:
                if retries.wait(retries.failed(operation, exc, records=len(items))):
                    return False
                continue
            retries.succeeded(operation)
            return True
        return True

    def delivered(self, records: Sequence[MarkedRecord]) -> None:
        """Account for purged records: metrics, and the end of any retry back-off."""
        if not records:
            return
        self._metrics.publish_latency.observe_many(_latencies(records))
        if self._attempts or self.solo:
            for record in records:
                self._attempts.pop(record.id, None)
                self.solo.discard(record.id)
        self._metrics.purged.inc(len(records))
        self._backoff.succeeded()

    def settle(self, failures: Sequence[tuple[MarkedRecord, Exception]]) -> set[int]:
        """Record failed deliveries: reset the retriable ones (and back off) and those refused with a
        shared error while not alone (published alone from now on), count attempts of the other
        permanent ones and dead-letter those out of attempts. The ids dead-lettered (none if the
        fence refused it): a copy of one waiting to go out must not."""
        if not failures:
            return set()
        retriable: list[int] = []
        suspects: list[int] = []
        failing: list[Failure] = []
        dead: list[Failure] = []
        solo = self.solo
        for record, err in failures:
            kind = classify(err)
            alone = record.id in solo
            log.warning(
                "delivery_failed", id=record.id, key=record.key, topic=record.topic, error=str(err), alone=alone
            )
            self._metrics.retries.labels(kind).inc()
            if kind == "retriable":
                retriable.append(record.id)
                continue
            if not alone and shared(err):
                suspects.append(record.id)
                continue
            failure = self._count_attempt(record, err)
            (dead if failure.attempts >= self._limits.max_attempts else failing).append(failure)
        solo.update(suspects)  # before the reset: a copy marked after it goes out alone
        store, leader_id = self._store, self._leader_id()
        if not (
            self.retry("reset", store.reset, retriable + suspects)
            and self.retry("fail", store.fail, failing)
            and (leader_id is None or self.retry("dead_letter", lambda f: store.dead_letter(f, leader_id), dead))
        ):
            return set()
        self._metrics.reset.inc(len(retriable) + len(suspects) + len(failing))
        if retriable:
            self._backoff.failed()
        for f in dead:
            self._attempts.pop(f.id, None)
            solo.discard(f.id)
            self._metrics.dead_lettered.labels(f.reason).inc()
            log.error("dead_lettered", id=f.id, key=f.key, reason=f.reason, attempts=f.attempts, error=f.error)
        return {f.id for f in dead}

    def _count_attempt(self, record: MarkedRecord, error: Exception) -> Failure:
        """This permanent failure's attempt number (from the row, or from memory)."""
        now = datetime.now(UTC)
        if self._store.tracks_attempts:
            attempts, first = record.attempts + 1, record.first_failure or now
        else:
            previous, first = self._attempts.get(record.id, (0, now))
            attempts = previous + 1
            self._attempts[record.id] = (attempts, first)
        return Failure(record.id, record.key, reason(error), str(error)[:2000], attempts, first)

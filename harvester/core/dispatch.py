"""The contract between the engine core and a delivery mode's dispatcher.

The core (:mod:`harvester.core.engine`) owns leadership terms, the fence, the mark loop, back-off
and shutdown; it hands every marked batch to one :class:`Dispatcher`, which publishes it and
completes it: :mod:`harvester.core.at_least_once` (per-key barriers and FIFOs, delivery reports,
purge/reset) or :mod:`harvester.core.exactly_once` (Kafka transactions, checkpoints, the purge
pipeline). Both sides share one :class:`LeaderState` under one condition variable.
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Protocol
from uuid import UUID

import structlog

from harvester.core.limits import Limits
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import FencedError, RefusedError
from harvester.core.records import MarkedRecord
from harvester.core.settle import RetryBackoff, Settler

log = structlog.get_logger("harvester.engine")


class LeaderState:
    """Leadership as the mark loop and the dispatcher see it. ``leader_id``, ``epoch`` and
    ``force_remark`` are guarded by ``cond``; ``stopping`` and ``still_leader`` need no lock."""

    def __init__(self, still_leader: Callable[[], bool]) -> None:
        self.cond = threading.Condition()
        self.stopping = threading.Event()
        # The elector's live view: it turns false the moment heartbeats are overdue, before the
        # LeaderFenced event is delivered, so a process resuming from a freeze publishes nothing.
        self.still_leader = still_leader
        self.leader_id: UUID | None = None  # the id records are marked with; None when not leading
        self.epoch = 0  # the fence epoch of the current term
        self.force_remark = False  # refresh the leader id before the next mark

    def current(self, leader_id: UUID) -> bool:
        """Whether records marked under ``leader_id`` may still go out (caller holds ``cond``)."""
        return self.leader_id == leader_id and not self.force_remark

    def request_remark(self) -> None:
        """Have the mark loop refresh the leader id, so everything unacknowledged is marked again."""
        with self.cond:
            self.force_remark = True
            self.cond.notify_all()


@dataclass(frozen=True, slots=True)
class Context:
    """What the core gives a dispatcher when it builds it."""

    state: LeaderState
    limits: Limits
    metrics: HarvesterMetrics
    settler: Settler
    backoff: RetryBackoff
    on_fenced: Callable[[FencedError], None]
    # Bound to every log line of the pipeline's threads (``shard`` when the outbox is sharded).
    labels: Mapping[str, object] = field(default_factory=dict)
    # The publisher can publish nothing more until an operator grants what Kafka refused.
    on_refused: Callable[[RefusedError], None] = lambda _: None


class Dispatcher(Protocol):
    """One delivery mode: publishes marked batches and completes them.

    Methods documented "caller holds the lock" run with ``state.cond`` held by the core."""

    @property
    def threads(self) -> Sequence[threading.Thread]:
        """The dispatcher's worker threads (started and joined by the core)."""
        ...

    def begin_term(self) -> None:
        """Mode-specific work at the start of a term, after the fence was bumped.

        Raises :class:`FencedError` (another leader took over) or ``StoreError`` (retry later)."""
        ...

    def dispatch(self, batch: Sequence[MarkedRecord], leader_id: UUID) -> None:
        """Publish a marked batch (may block on the mode's in-flight bounds)."""
        ...

    def mark_started(self) -> None:
        """A mark query is about to run (caller holds the lock)."""
        ...

    def mark_ended(self) -> None:
        """A mark query failed or found nothing: no :meth:`dispatch` follows (caller holds the lock)."""
        ...

    def has_room(self) -> bool:
        """Whether another batch may be marked now (caller holds the lock)."""
        ...

    def check_stuck(self) -> None:
        """Request a remark if records have waited too long (caller holds the lock)."""
        ...

    def before_remark(self) -> None:
        """Settle what the refreshed leader id would otherwise publish again (caller holds the lock)."""
        ...

    def discard_waiting(self) -> None:
        """Forget records marked but not yet published (caller holds the lock)."""
        ...

    def busy(self) -> bool:
        """Whether records are published and not yet completed (caller holds the lock)."""
        ...

    @property
    def in_flight_records(self) -> int:
        """Records published and not yet completed."""
        ...

    @property
    def in_flight_keys(self) -> int:
        """Keys with a record in flight."""
        ...

    @property
    def queued_records(self) -> int:
        """Marked records waiting behind a busy key."""
        ...

    def close(self, timeout: float) -> None:
        """Release the publisher (bounded by ``timeout``) and tell the worker threads to exit."""
        ...


DispatcherFactory = Callable[[Context], Dispatcher]


def worker(loop: Callable[[], None], name: str, labels: Mapping[str, object] | None = None) -> threading.Thread:
    """A daemon thread running ``loop`` that logs the error ending it: the thread is gone then, and
    :attr:`harvester.core.engine.Engine.alive` reports it. ``labels`` are bound to every log line
    the thread writes (and suffix its name: ``harvester-mark-2`` is shard 2's mark thread)."""
    labels = dict(labels or {})

    def run() -> None:
        structlog.contextvars.bind_contextvars(**labels)
        try:
            loop()
        except Exception:
            log.exception("thread_died", thread=threading.current_thread().name)

    suffix = "".join(f"-{v}" for v in labels.values())
    return threading.Thread(target=run, name=name + suffix, daemon=True)

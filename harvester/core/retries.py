"""Store statements retried until they succeed, made visible: a bounded exponential back-off per
operation, one log line with the reason per back-off step, a metric, and a stall clock.

A statement that keeps failing (the database down, or one it refuses every time, such as a dead
letter wider than its table's column) must not loop silently. Each failure of an operation logs
its reason and the next delay; the delays double from ``io_error_backoff`` up to
``max_retry_backoff``; the first success ends the back-off. An operation that has failed for
``stall_timeout`` without a success in between stalls the harvester: :meth:`StoreRetries.stalled`
says which and why, and the reaper's ``/healthz`` turns 503. The records concerned stay in the
outbox throughout; at shutdown the retries are abandoned and the next leader marks them again.

:meth:`StoreRetries.unreachable_seconds` is how long the database path has failed: since the first
:class:`StoreUnreachableError` after the last success of any operation, dated from when its call
began (a statement that waited ``statementTimeout`` for an answer shows a path that has failed since
it was sent), but not before that success. The harvester's elector yields leadership when that
exceeds ``heartbeat_timeout``, so that a process whose path works leads: after a stall, about
``max(statementTimeout, heartbeatTimeout)`` after the path failed.
"""

from __future__ import annotations

import threading
import time
from dataclasses import dataclass

import structlog

from harvester.core.limits import Limits
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import StoreUnreachableError

log = structlog.get_logger("harvester.engine")

PROBE = "probe"
"""The operation a standby books its periodic look at the database under (it runs no other
statement); any success clears it, since every statement goes over the same path."""


@dataclass(frozen=True, slots=True)
class Stall:
    """An operation that has failed without a success for ``seconds``, and its last error, in the
    outbox and shard whose pipeline retries it (shard 0 when the outbox is not sharded)."""

    operation: str
    seconds: float
    error: str
    outbox: str = ""
    shard: int = 0


@dataclass(slots=True)
class _Failing:
    since: float  # monotonic time of the first failure since the last success
    attempts: int = 0
    error: str = ""
    reported: bool = False  # the stall was logged


class StoreRetries:
    """The back-off state of every retried store operation (``mark``, ``purge``, ``dead_letter``, ...);
    thread-safe, one instance per engine. ``outbox`` and ``shard`` name the engine's pipeline in its
    stalls and its log lines, whichever thread asks (a health probe's has no pipeline labels bound)."""

    def __init__(self, limits: Limits, metrics: HarvesterMetrics, *, outbox: str = "", shard: int = 0) -> None:
        self._outbox, self._shard = outbox, shard
        self._log = log.bind(**({"outbox": outbox} if outbox else {}), shard=shard)
        self._first = limits.io_error_backoff.total_seconds()
        self._ceiling = max(self._first, limits.max_retry_backoff.total_seconds())
        self._stall_after = limits.stall_timeout.total_seconds()
        self._metrics = metrics
        self._lock = threading.Lock()
        self._failing: dict[str, _Failing] = {}
        self._unreachable_since: float | None = None  # first path failure since the last success
        self._last_success = float("-inf")  # monotonic time of the last success of any operation
        self._abandoned = threading.Event()
        metrics.stalled_seconds.set_function(lambda: stall.seconds if (stall := self.stalled()) else 0.0)

    def failed(
        self, operation: str, error: BaseException, *, retry_in: float | None = None, **context: object
    ) -> float:
        """Book a failure of ``operation`` and log it; return the seconds to wait before the next try
        (``retry_in`` when the caller keeps its own pace, as the probe does)."""
        now = time.monotonic()
        with self._lock:
            failing = self._failing.setdefault(operation, _Failing(now))
            if isinstance(error, StoreUnreachableError) and self._unreachable_since is None:
                began = now if error.since is None else min(now, error.since)
                self._unreachable_since = max(began, self._last_success)
            backoff = min(self._ceiling, self._first * 2.0 ** min(failing.attempts, 30))
            delay = backoff if retry_in is None else retry_in
            failing.attempts += 1
            failing.error = str(error)
            seconds = now - failing.since
            attempt = failing.attempts
        self._metrics.store_retries.labels(operation).inc()
        self._log.warning(
            "store_retry",
            operation=operation,
            error=str(error),
            attempt=attempt,
            failing_seconds=round(seconds, 1),
            retry_in_seconds=round(delay, 2),
            **context,
        )
        self.stalled()  # logs the stall as soon as there is one
        return delay

    def succeeded(self, operation: str) -> None:
        """``operation`` went through: its back-off and stall clock start afresh, and the probe's
        (the path works)."""
        self._unreachable_since = None  # the path works
        self._last_success = time.monotonic()
        if operation not in self._failing and PROBE not in self._failing:  # the usual case, without the lock
            return
        with self._lock:
            recovered = [(op, f) for op in {operation, PROBE} if (f := self._failing.pop(op, None)) is not None]
        for op, failing in recovered:
            self._log.info(
                "store_recovered",
                operation=op,
                attempts=failing.attempts,
                failing_seconds=round(time.monotonic() - failing.since, 1),
            )

    def forget(self, *operations: str) -> None:
        """Leadership lost: these operations are no longer retried, so they stall nothing."""
        with self._lock:
            for operation in operations:
                self._failing.pop(operation, None)
            if not self._failing:
                self._unreachable_since = None

    def unreachable_seconds(self) -> float:
        """How long every store call has failed to reach the database (0 when the path works)."""
        since = self._unreachable_since
        return 0.0 if since is None else time.monotonic() - since

    def stalled(self) -> Stall | None:
        """The operation failing for longest, if that is ``stall_timeout`` or more (logged once)."""
        now = time.monotonic()
        with self._lock:
            oldest = min(self._failing.items(), key=lambda item: item[1].since, default=None)
            if oldest is None or now - oldest[1].since < self._stall_after:
                return None
            operation, failing = oldest
            stall = Stall(operation, round(now - failing.since, 1), failing.error, self._outbox, self._shard)
            first, failing.reported = not failing.reported, True
        if first:
            self._log.error(
                "store_stalled",
                operation=operation,
                error=stall.error,
                failing_seconds=stall.seconds,
                hint="the records concerned stay in the outbox; /healthz reports the stall until it succeeds",
            )
        return stall

    def wait(self, seconds: float) -> bool:
        """Sleep before the next try; True (at once) when the retries were abandoned."""
        return self._abandoned.wait(seconds)

    def abandon(self) -> None:
        """Shutdown: stop retrying (the records concerned stay in the outbox for the next leader)."""
        self._abandoned.set()

"""The outboxes one ``reaper run`` harvests: one :class:`Outbox` per ``harvest:`` section.

A goharvest file's single ``harvest:`` mapping is the one-item case of a list of sections, and runs
through the same code: each outbox gets its own :class:`~harvester.harvester.Harvester` (store,
elector, engines, metrics in a private registry) and a thread of its own that watches it and refreshes
its health. The two cases differ only in what follows when an outbox cannot start or ends by itself.
Alone, the process exits with the reason (an orchestrator restarts it; an operator reads one line).
Among several, the outbox is ``supervised``: logged and started again in the background with a
back-off, until the reaper stops, so that nothing one outbox does blocks another; that includes its
Kafka being unreachable when ``run`` started (each attempt then first looks for Kafka, so the reason
logged is the connection's). They share only the process, the HTTP endpoint and the log.

Metrics: :class:`OutboxLabels` exports each outbox's registry, with an ``outbox`` label (the
section's table) when there are several. :class:`Probes` answers ``/healthz`` (threads alive, and
no statement stalled: the body names the stalled outbox, shard and statement) and ``/readyz``.
"""

from __future__ import annotations

import contextlib
import threading
import time
from collections.abc import Callable, Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from harvester.daemon import logs
from harvester.daemon.check import reach_kafka
from harvester.daemon.errors import FailError
from harvester.daemon.settings import ReaperSettings

if TYPE_CHECKING:
    from harvester.core.events import Event
    from harvester.core.retries import Stall
    from harvester.harvester import Harvester

log = structlog.get_logger("reaper")

FIRST_RETRY = 1.0
"""Seconds before a supervised outbox that could not start (or ended) is started again; doubled up
to :data:`LAST_RETRY`."""
LAST_RETRY = 30.0
HEALTH_INTERVAL = 5.0
"""Seconds between two health checks of a running outbox (each bounded to about 4 s)."""
KAFKA_ATTEMPT = 2.0
"""Bound on the look for Kafka that precedes each start of an outbox whose Kafka was unreachable."""


class Outbox:
    """One harvest section: its harvester, started (and, when ``supervised``, started again) and
    watched by a thread of its own."""

    def __init__(
        self,
        settings: ReaperSettings,
        stop: threading.Event,
        *,
        supervised: bool,
        on_event: Callable[[Event], None] | None = None,
        kafka_unreachable: str | None = None,
    ) -> None:
        self.settings = settings
        self.name = settings.harvest.table.qualified
        self.registry = CollectorRegistry()
        self.state = "starting" if kafka_unreachable is None else "retrying"  # or running
        self.error: str | None = kafka_unreachable
        # Why its Kafka was not reached, until it is (``run`` waited for it in vain).
        self._kafka_down = kafka_unreachable
        self.ended = threading.Event()
        """Set when an outbox that is not supervised ended by itself; :attr:`failure` says why."""
        self.failure: str | None = None
        self._supervised = supervised
        self._on_event = on_event
        self._stop = stop
        self._lock = threading.Lock()
        self._harvester: Harvester | None = None
        self._health: dict[str, object] = {}  # the running harvester's latest health()
        self._thread: threading.Thread | None = None

    @property
    def labels(self) -> dict[str, str]:
        """What this outbox's log lines and series carry: ``outbox`` when the reaper harvests several."""
        return {"outbox": self.name} if self._supervised else {}

    def start(self) -> None:
        """Start harvesting. Not supervised: now, raising :class:`FailError` (the setting to look at)
        when the harvester cannot start. Supervised: in the background, retried until it starts."""
        if self._supervised:
            target: Callable[[], None] = self._supervise
        else:
            harvester = self._attempt()
            target = lambda: self._watch_once(harvester)  # noqa: E731
        self._thread = threading.Thread(target=target, name=f"reaper-outbox-{self.name}", daemon=True)
        self._thread.start()

    def _build(self) -> Harvester:
        from harvester.harvester import Harvester

        harvest = self.settings.harvest
        # librdkafka logs to stderr on its own unless given a logger: route it through ours, so its
        # lines are JSON too, carry the instance name, are redacted, and a line repeated is folded;
        # so are the errors its clients report.
        rdkafka = {"logger": logs.librdkafka_logger(), "error_cb": logs.librdkafka_error_cb(**self.labels)}
        kafka = {**harvest.base_kafka_config, **rdkafka}
        # A fresh registry per attempt: a harvester registers its series once, in its own registry.
        self.registry = CollectorRegistry()
        return Harvester(
            harvest.model_copy(update={"base_kafka_config": kafka}),
            on_event=self._on_event,
            registry=self.registry,
            labels=self.labels,
        )

    def _attempt(self) -> Harvester:
        """Build and start a harvester; :class:`FailError` naming the setting when it cannot start."""
        if self._kafka_down is not None:
            # The connection's cause in one line, rather than the leader topic's time-out after it.
            reach_kafka(self.settings, KAFKA_ATTEMPT)
            self._kafka_down = None
        harvester = self._build()
        try:
            harvester.start()
        except Exception as exc:
            with contextlib.suppress(Exception):  # no background thread of the failed start lives on
                harvester.stop(1.0)
            raise start_error(exc) from None
        with self._lock:
            self._harvester, self._health = harvester, {}
            self.state, self.error = "running", None
        return harvester

    def _watch_once(self, harvester: Harvester) -> None:
        if self._watch(harvester):
            self.failure = harvester.failure
            self.ended.set()

    def _supervise(self) -> None:
        delay = FIRST_RETRY
        failed = self._kafka_down  # run() waited for this outbox's Kafka in vain: said at once
        while not self._stop.is_set():
            try:
                if failed is not None:
                    raise FailError(failed)
                harvester = self._attempt()
            except FailError as exc:
                failed = None
                self._not_running("outbox_start_failed", str(exc), delay)
            else:
                delay = FIRST_RETRY
                log.info("outbox_started", outbox=self.name, group=self.settings.harvest.group_id)
                if not self._watch(harvester):
                    return  # stop() stops the harvester, by the shutdown deadline
                with self._lock:
                    self._harvester, self._health = None, {}
                self._not_running("outbox_ended", harvester.failure or "the harvester ended unexpectedly", delay)
            if self._stop.wait(delay):
                return
            delay = min(delay * 2, LAST_RETRY)

    def _watch(self, harvester: Harvester) -> bool:
        """Refresh the health of a running harvester every :data:`HEALTH_INTERVAL` until it ends by
        itself (True) or the reaper stops (False)."""
        while True:
            try:
                health = dict(harvester.health())
            except Exception as exc:  # a failing check means "not ready", never a dead watcher
                health = {"running": False, "error": type(exc).__name__}
            with self._lock:
                self._health = health
            for _ in range(int(HEALTH_INTERVAL / 0.5)):
                if self._stop.wait(0.5):
                    return False
                if harvester.wait(0):
                    return True

    def _not_running(self, event: str, reason: str, delay: float) -> None:
        with self._lock:
            self.state, self.error = "retrying", reason
        log.error(event, outbox=self.name, error=reason, retry_in_seconds=delay)

    def stop(self, deadline: float) -> None:
        """Stop the harvester, if running, by ``deadline`` (``time.monotonic()``); the reaper's stop
        event is set by then, so no new start follows. A start still under way (a slow connection) is
        waited for until the deadline, then left to the process's exit."""
        if self._thread is not None:
            self._thread.join(max(0.0, deadline - time.monotonic()))
        with self._lock:
            harvester = self._harvester
        if harvester is not None:
            harvester.stop(max(0.0, deadline - time.monotonic()))

    @property
    def in_flight_records(self) -> int:
        harvester = self._harvester
        return harvester.in_flight_records if harvester is not None else 0

    def liveness(self) -> tuple[bool, Stall | None]:
        """Whether the harvester's threads live, and its longest stall, if any (an outbox not running
        is retried, or ends the process: not dead)."""
        harvester = self._harvester
        if harvester is None:
            return True, None
        return harvester.threads_alive, harvester.stalled

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """Ready when running with its database, its table and Kafka reachable (a standby too: it
        takes over at once when needed)."""
        with self._lock:
            running, health, state, error = self._harvester is not None, self._health, self.state, self.error
        if not running:
            return False, {"running": False, "state": state, **({"error": error} if error else {})}
        keys = ("is_leader", "leading_shards", "database_ok", "outbox_ok", "kafka_ok", "running")
        details: dict[str, object] = {k: health[k] for k in keys if k in health}
        ok = all(bool(health.get(k)) for k in ("running", "database_ok", "outbox_ok", "kafka_ok"))
        return ok, {**details, "state": state}


def start_error(exc: Exception) -> FailError:
    """Why ``Harvester.start()`` failed, as a one-line error naming the setting to look at."""
    from harvester.kafka.topics import KafkaUnreachableError, TopicError
    from harvester.postgres.log.rows import FailoverRiskError
    from harvester.postgres.table.store import OutboxMissingError, ShardCountError, StoreError
    from leader.topic import LeaderTopicError

    if isinstance(exc, ShardCountError | FailoverRiskError):  # it names the setting
        return FailError(str(exc))
    if isinstance(exc, KafkaUnreachableError):  # looking up the checkpoint topic
        where = "harvest.baseKafkaConfig: bootstrap.servers"
        return FailError(f"Kafka unreachable at {exc.servers} ({where}): {exc.reason}")
    if isinstance(exc, TopicError):
        return FailError(f"harvest.checkpointTopic: {exc}")
    if isinstance(exc, OutboxMissingError):
        return FailError(f"harvest.outboxTable: {exc}")
    if isinstance(exc, StoreError):  # PostgreSQL unreachable, or a table of an unsupported layout
        return FailError(f"PostgreSQL (harvest.dataSource, harvest.outboxTable): {exc}")
    if isinstance(exc, LeaderTopicError):  # Kafka unreachable, or the topic absent and not creatable
        return FailError(f"harvest.leaderTopic: {exc}")
    log.debug("start_failed", exc_info=exc)
    return FailError(f"cannot start: {type(exc).__name__}: {exc}", code=1)


class OutboxLabels(Collector):
    """Exports every outbox's series; labelled ``outbox`` when there are several, as they always
    were (unlabelled) when there is one."""

    def __init__(self, outboxes: Sequence[Outbox]) -> None:
        self._outboxes = list(outboxes)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for outbox in self._outboxes:
            for family in outbox.registry.collect():
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    labels = {**outbox.labels, **sample.labels}
                    out.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        yield from merged.values()


class Probes:
    """``/healthz`` and ``/readyz`` over every outbox."""

    def __init__(self, outboxes: Sequence[Outbox]) -> None:
        self._outboxes = list(outboxes)

    def liveness(self) -> tuple[bool, Mapping[str, object]]:
        """Alive when every running harvester's threads live and none has stalled; the longest stall
        is named (outbox, shard, statement, for how long, why), the others in their log lines."""
        alive, stalls = True, []
        for outbox in self._outboxes:
            threads, stall = outbox.liveness()
            alive = alive and threads
            if stall is not None:
                stalls.append(stall)
        details: dict[str, object] = {"threads_alive": alive}
        # Outboxes retried in the background: named, but no reason to restart the process.
        retrying = {o.name: o.error for o in self._outboxes if o.state == "retrying"}
        if retrying:
            details["retrying"] = retrying
        worst = max(stalls, key=lambda stall: stall.seconds, default=None)
        if worst is not None:
            details["stalled"] = {
                "outbox": worst.outbox,
                "shard": worst.shard,
                "operation": worst.operation,
                "seconds": worst.seconds,
                "error": worst.error,
            }
        return alive and worst is None, details

    def readiness(self) -> tuple[bool, Mapping[str, object]]:
        """One outbox: its readiness. Several: ready when every one is, each under ``outboxes``."""
        each = {o.name: o.readiness() for o in self._outboxes}
        if len(each) == 1:
            return next(iter(each.values()))
        ok = all(ready for ready, _ in each.values())
        leading = any(bool(details.get("is_leader")) for _, details in each.values())
        return ok, {"is_leader": leading, "outboxes": {name: details for name, (_, details) in each.items()}}


def in_flight(outboxes: Sequence[Outbox]) -> int | dict[str, int]:
    """Records in flight: a number for one outbox, by outbox for several."""
    if len(outboxes) == 1:
        return outboxes[0].in_flight_records
    return {o.name: o.in_flight_records for o in outboxes}


def leader_in_logs(event: Any) -> None:
    """With one outbox, every log line carries the leader id while this instance leads."""
    from harvester.core.events import LeaderAcquired, LeaderFenced, LeaderRefreshed, LeaderRevoked

    if isinstance(event, LeaderAcquired | LeaderRefreshed):
        logs.set_leader(event.leader_id)
    elif isinstance(event, LeaderRevoked | LeaderFenced):
        logs.set_leader(None)

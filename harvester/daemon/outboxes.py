"""``reaper run`` over several harvest sections: one process harvests several outboxes, each isolated.

Each section gets its own :class:`~harvester.harvester.Harvester` (store, elector, engines, metrics)
and a supervisor thread that starts it and starts it again when it cannot start (its table is
missing, its database or Kafka unreachable, its group disagreeing on the number of shards) or when
it ended by itself, with a back-off, until the reaper stops. Nothing one outbox does blocks another:
they share only the process, the HTTP endpoint and the log. A section not running is logged with
its reason and shown by ``/readyz``, which answers 503 until every section runs.

Metrics: each harvester keeps a private registry, exported with an ``outbox`` label (the section's
table) by :class:`OutboxLabels`. Log lines of a section's threads carry ``outbox``.
"""

from __future__ import annotations

import contextlib
import logging
import signal
import threading
from collections.abc import Iterator, Mapping, Sequence
from typing import TYPE_CHECKING, Any

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import Metric
from prometheus_client.registry import Collector

from harvester.daemon.check import validate_election, validate_kafka_config
from harvester.daemon.errors import FailError
from harvester.daemon.run import _close as close
from harvester.daemon.run import _listen as listen
from harvester.daemon.run import _Signals as Signals
from harvester.daemon.run import start_error
from harvester.daemon.settings import ReaperSettings, defaulted_connections

if TYPE_CHECKING:
    from harvester.harvester import Harvester

log = structlog.get_logger("reaper")

FIRST_RETRY = 1.0
"""Seconds before a section that could not start (or ended) is started again; doubled up to :data:`LAST_RETRY`."""
LAST_RETRY = 30.0
HEALTH_INTERVAL = 5.0
"""Seconds between two health checks of a running section (each bounded to about 4 s)."""


class Outbox:
    """One harvest section: its harvester, started (and started again) by a supervisor thread."""

    def __init__(self, settings: ReaperSettings, stop: threading.Event) -> None:
        self.settings = settings
        self.name = settings.harvest.table.qualified
        self.registry = CollectorRegistry()
        self.state = "starting"  # starting, running, retrying
        self.error: str | None = None
        self._stop = stop
        self._lock = threading.Lock()
        self._harvester: Harvester | None = None
        self._health: dict[str, object] = {}  # the running harvester's latest health()
        self._thread = threading.Thread(target=self._supervise, name=f"reaper-outbox-{self.name}", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def _build(self) -> Harvester:
        from harvester.harvester import Harvester

        harvest = self.settings.harvest
        kafka = {**harvest.base_kafka_config, "logger": logging.getLogger("rdkafka")}
        # A fresh registry per attempt: a harvester registers its series once, in its own registry.
        self.registry = CollectorRegistry()
        return Harvester(
            harvest.model_copy(update={"base_kafka_config": kafka}),
            registry=self.registry,
            labels={"outbox": self.name},
        )

    def _supervise(self) -> None:
        delay = FIRST_RETRY
        while not self._stop.is_set():
            harvester = self._build()
            try:
                harvester.start()
            except Exception as exc:
                with contextlib.suppress(Exception):
                    harvester.stop(1.0)
                self._not_running("outbox_start_failed", str(start_error(exc)), delay)
            else:
                with self._lock:
                    self._harvester, self._health = harvester, {}
                    self.state, self.error = "running", None
                delay = FIRST_RETRY
                log.info("outbox_started", outbox=self.name, group=self.settings.harvest.group_id)
                if not self._watch(harvester):
                    return  # stop() stops the harvester, within the shutdown timeout
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
            except Exception as exc:  # a failing check means "not ready", never a dead supervisor
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

    def stop(self, timeout: float) -> None:
        """Stop the harvester, if running (the stop event is set by then: no new start follows). A start
        still under way (a slow connection) is waited for up to ``timeout``, then left to the exit."""
        self._thread.join(timeout)
        with self._lock:
            harvester = self._harvester
        if harvester is not None:
            harvester.stop(timeout)

    @property
    def in_flight_records(self) -> int:
        harvester = self._harvester
        return harvester.in_flight_records if harvester is not None else 0

    def liveness(self) -> bool:
        harvester = self._harvester
        return harvester is None or harvester.alive  # a section not running is retried, not dead

    def readiness(self) -> tuple[bool, dict[str, object]]:
        """Ready when running with its database, its table and Kafka reachable (a standby too)."""
        with self._lock:
            running, health, state, error = self._harvester is not None, self._health, self.state, self.error
        if not running:
            return False, {"running": False, "state": state, **({"error": error} if error else {})}
        keys = ("is_leader", "leading_shards", "database_ok", "outbox_ok", "kafka_ok", "running")
        details: dict[str, object] = {k: health[k] for k in keys if k in health}
        ok = all(bool(health.get(k)) for k in ("running", "database_ok", "outbox_ok", "kafka_ok"))
        return ok, {**details, "state": state}


class OutboxLabels(Collector):
    """Exports every section's series as one set of series labelled ``outbox``."""

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
                    labels = {"outbox": outbox.name, **sample.labels}
                    out.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        yield from merged.values()


class _Probes:
    """``/healthz`` and ``/readyz`` over every section: ready when every section is."""

    def __init__(self, outboxes: Sequence[Outbox]) -> None:
        self._outboxes = list(outboxes)

    def liveness(self) -> tuple[bool, Mapping[str, object]]:
        alive = all(o.liveness() for o in self._outboxes)
        return alive, {"threads_alive": alive}

    def readiness(self) -> tuple[bool, Mapping[str, object]]:
        each = {o.name: o.readiness() for o in self._outboxes}
        ok = all(ready for ready, _ in each.values())
        leading = any(bool(details.get("is_leader")) for _, details in each.values())
        return ok, {"is_leader": leading, "outboxes": {name: details for name, (_, details) in each.items()}}


def run_outboxes(settings: ReaperSettings, version: str) -> int:
    """``reaper run`` for a file of several harvest sections; returns the exit code."""
    from prometheus_client import Gauge

    sections = settings.sections
    for section in sections:  # configuration mistakes end the process before anything starts
        try:
            validate_kafka_config(section)
            validate_election(section)
        except FailError as exc:
            raise FailError(_in_section(str(exc), section, sections), code=exc.code) from None
    stop = threading.Event()
    outboxes = [Outbox(section, stop) for section in sections]
    registry = CollectorRegistry()
    info = Gauge("reaper_info", "Always 1; labels describe this reaper.", ["version", "instance"], registry=registry)
    info.labels(version=version, instance=settings.harvest.name).set(1)
    registry.register(OutboxLabels(outboxes))
    probes = _Probes(outboxes)
    server = listen(settings, registry, probes) if settings.http.enabled else None
    if server is not None:
        server.start()
    signals = Signals()
    signals.install()
    try:
        for outbox in outboxes:
            outbox.start()
        defaults = sorted({d for section in sections for d in defaulted_connections(section)})
        if defaults:
            log.warning("connection_defaults", settings=defaults, hint="set them in the file, or REAPER_HARVEST__*")
        log.info(
            "reaper_started",
            version=version,
            outboxes=[o.name for o in outboxes],
            http_port=server.port if server else None,
        )
        signals.stop.wait()
        stop.set()
        name = signal.Signals(signals.received).name if signals.received else "signal"
        timeout = settings.shutdown.timeout.total_seconds()
        in_flight = {o.name: o.in_flight_records for o in outboxes}
        log.info("reaper_stopping", signal=name, timeout_seconds=timeout, in_flight=in_flight)
        return _stop_all(outboxes, timeout, server)
    finally:
        signals.restore()


def _stop_all(outboxes: Sequence[Outbox], timeout: float, server: Any) -> int:
    """Stop every section at once (each within ``timeout``), on threads: the main thread stays free
    to act on a second signal."""
    failed: list[tuple[str, BaseException]] = []

    def stop(outbox: Outbox) -> None:
        try:
            outbox.stop(timeout)
        except Exception as exc:  # reported below, as a log line rather than a raw thread traceback
            failed.append((outbox.name, exc))

    stoppers = [threading.Thread(target=stop, args=(o,), name=f"reaper-stop-{o.name}", daemon=True) for o in outboxes]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        while stopper.is_alive():
            stopper.join(0.2)
    close(server)
    for name, exc in failed:
        log.error("reaper_stop_failed", outbox=name, exc_info=exc)
    if failed:
        return 1
    log.info("reaper_stopped")
    return 0


def _in_section(message: str, section: ReaperSettings, sections: Sequence[ReaperSettings]) -> str:
    """Name the section in a message that names a harvest setting."""
    index = next(i for i, s in enumerate(sections) if s is section)
    return message.replace("harvest.", f"harvest[{index}].")

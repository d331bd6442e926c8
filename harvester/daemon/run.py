"""``reaper run``: the harvester as a daemon, with its HTTP endpoints, until a signal."""

from __future__ import annotations

import contextlib
import errno
import os
import signal
import sys
import threading
import time
from collections.abc import Mapping
from types import FrameType
from typing import TYPE_CHECKING, Any, Protocol

from harvester.daemon import logs
from harvester.daemon.check import connect_pg, reach_kafka, validate_election, validate_kafka_config
from harvester.daemon.errors import FailError
from harvester.daemon.settings import ReaperSettings, defaulted_connections

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from harvester.daemon.http import HttpServer
    from harvester.harvester import Harvester


class _Signals:
    """First SIGTERM/SIGINT asks for a graceful stop; a second one exits at once."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers found by :meth:`install` (matters when ``main`` runs in-process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop.is_set():
            # Nothing is lost: unacknowledged records stay marked in the outbox and the next leader
            # marks them again. os._exit skips the graceful path that is evidently stuck.
            os.write(2, f"reaper: second signal {signal.Signals(signum).name}: exiting now\n".encode())
            os._exit(128 + signum)
        self.received = signum
        self.stop.set()


class _Probes(Protocol):
    """What the HTTP endpoint asks: a :class:`_HealthCache`, or the probes over several outboxes."""

    def liveness(self) -> tuple[bool, Mapping[str, object]]: ...

    def readiness(self) -> tuple[bool, Mapping[str, object]]: ...


class _HealthCache:
    """Readiness from ``Harvester.health()``, refreshed in the background so probes answer at once."""

    def __init__(self, harvester: Harvester, interval: float) -> None:
        self._harvester = harvester
        self._interval = interval
        self._lock = threading.Lock()
        self._latest: dict[str, Any] = {"database_ok": False, "kafka_ok": False, "is_leader": False, "running": False}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reaper-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def _loop(self) -> None:
        while True:
            try:
                latest = dict(self._harvester.health())
            except Exception as exc:  # a failing check means "not ready", never a dead thread
                latest = {"database_ok": False, "kafka_ok": False, "is_leader": False, "running": False,
                          "error": type(exc).__name__}
            with self._lock:
                self._latest = latest
            if self._closed.wait(self._interval):
                return

    def liveness(self) -> tuple[bool, Mapping[str, object]]:
        threads, stall = self._harvester.threads_alive, self._harvester.stalled
        details: dict[str, object] = {"threads_alive": threads}
        if stall is not None:
            details["stalled"] = {"operation": stall.operation, "seconds": stall.seconds, "error": stall.error}
        return threads and stall is None, details

    def readiness(self) -> tuple[bool, Mapping[str, object]]:
        with self._lock:
            latest = dict(self._latest)
        # A standby is ready too: it reaches both services and takes over at once when needed.
        ok = bool(latest.get("running") and latest.get("database_ok") and latest.get("kafka_ok"))
        keys = ("is_leader", "leading_shards", "database_ok", "kafka_ok", "running")
        return ok, {k: latest[k] for k in keys if k in latest}


def run(settings: ReaperSettings, version: str) -> int:
    """Build the harvester and the HTTP endpoint, then serve until a signal."""
    from prometheus_client import CollectorRegistry, Gauge

    from harvester.core.events import LeaderAcquired, LeaderFenced, LeaderRefreshed, LeaderRevoked
    from harvester.harvester import Harvester

    if len(settings.harvests) > 1:  # several outboxes: one supervised harvester each
        from harvester.daemon.outboxes import run_outboxes

        return run_outboxes(settings, version)
    harvest = settings.harvest

    def on_event(event: object) -> None:
        if isinstance(event, LeaderAcquired | LeaderRefreshed):
            logs.set_leader(event.leader_id)
        elif isinstance(event, LeaderRevoked | LeaderFenced):
            logs.set_leader(None)

    validate_kafka_config(settings)
    validate_election(settings)
    reach_kafka(settings, KAFKA_START_TIMEOUT, say_waiting=True)
    # librdkafka logs to stderr on its own unless given a logger: route it through ours, so its lines
    # are JSON too, carry the instance name, are redacted, and a line repeated is folded; so are the
    # errors its clients report.
    kafka = {**harvest.base_kafka_config, "logger": logs.librdkafka_logger(), "error_cb": logs.librdkafka_error_cb()}
    harvest = harvest.model_copy(update={"base_kafka_config": kafka})
    registry = CollectorRegistry()
    info = Gauge("reaper_info", "Always 1; labels describe this reaper.", ["version", "instance"], registry=registry)
    info.labels(version=version, instance=harvest.name).set(1)
    harvester = Harvester(harvest, on_event=on_event, registry=registry)
    health = _HealthCache(harvester, interval=5.0)
    server: HttpServer | None = None
    if settings.http.enabled:
        server = _listen(settings, registry, health)
        server.start()

    signals = _Signals()
    signals.install()
    try:
        return _serve(settings, version, harvester, health, server, signals)
    finally:
        signals.restore()


def _listen(settings: ReaperSettings, registry: CollectorRegistry, health: _Probes) -> HttpServer:
    """Bind the HTTP endpoint; raise :class:`FailError` when it cannot listen.

    A port the configuration set (``http.port`` in the file, or ``REAPER_HTTP__PORT``) is used or
    refused. A defaulted port that is busy (another reaper on this host: goharvest's failover set-up,
    whose users never configured an HTTP port) gives way to a free port chosen by the OS, logged here
    and in ``reaper_started``.
    """
    import structlog

    from harvester.daemon.http import HttpServer

    http = settings.http

    def bind(port: int) -> HttpServer:
        return HttpServer(registry, host=http.host, port=port, liveness=health.liveness, readiness=health.readiness)

    try:
        return bind(http.port)
    except OSError as exc:
        error = exc
    if not settings.http_port_explicit and error.errno in _BUSY:
        try:
            server = bind(0)
        except OSError:
            pass  # the host is the problem, not the port: report the port that was asked for
        else:
            structlog.get_logger("reaper").warning(
                "http_port_in_use",
                default_port=http.port,
                http_port=server.port,
                reason=error.strerror,
                hint="set http.port (or REAPER_HTTP__PORT) to choose the port",
            )
            return server
    raise FailError(f"http.port: cannot listen on {http.host}:{http.port}: {error.strerror}") from None


KAFKA_START_TIMEOUT = 30.0
"""How long ``run`` waits for Kafka at start (librdkafka reconnects with back-off meanwhile): long
enough for a sidecar started together with its broker, then exit 2 naming the cause."""

_STOP_TAIL = 2.0
"""Seconds of ``shutdown.timeout`` kept from the harvester's stop for closing the HTTP endpoint and
for the process's exit, where librdkafka's clients are destroyed (about a second with a broker down)."""

_BUSY = (errno.EADDRINUSE, errno.EACCES)
"""Bind errors after which a defaulted ``http.port`` falls back to a free one."""


def _serve(
    settings: ReaperSettings,
    version: str,
    harvester: Harvester,
    health: _HealthCache,
    server: HttpServer | None,
    signals: _Signals,
) -> int:
    """Start the harvester and run until a signal (or its unexpected end); return the exit code."""
    import structlog

    harvest = settings.harvest
    log = structlog.get_logger("reaper")
    try:
        harvester.start()
    except Exception as exc:
        _abandon(harvester, server)
        raise start_error(exc) from None
    health.start()
    defaults = defaulted_connections(settings)
    if defaults:
        log.warning("connection_defaults", settings=defaults, hint="set them in the file, or REAPER_HARVEST__*")
    for column in _narrower_columns(settings):
        log.warning("narrower_than_outbox", column=str(column))
    log.info(
        "reaper_started",
        version=version,
        table=harvest.table.qualified,
        shards=harvest.shards,
        group=harvest.group_id,
        topic=harvest.topic,
        http_port=server.port if server else None,
    )
    while not signals.stop.wait(0.5):
        if harvester.wait(0):
            health.close()
            _close(server)
            if harvester.failure is not None:
                raise FailError(harvester.failure, code=1)
            log.error("harvester_ended_unexpectedly")
            return 1
    name = signal.Signals(signals.received).name if signals.received else "signal"
    timeout = settings.shutdown.timeout.total_seconds()
    log.info("reaper_stopping", signal=name, timeout_seconds=timeout, in_flight=harvester.in_flight_records)
    failed: list[BaseException] = []

    def stop() -> None:
        try:
            harvester.stop(max(0.0, timeout - _STOP_TAIL))
        except Exception as exc:  # reported below, as a log line rather than a raw thread traceback
            failed.append(exc)

    # stop() runs on its own thread so the main thread stays free to act on a second signal at once,
    # even while the stop blocks inside librdkafka.
    stopper = threading.Thread(target=stop, name="reaper-stop", daemon=True)
    stopper.start()
    deadline = time.monotonic() + timeout
    while stopper.is_alive() and time.monotonic() < deadline:
        stopper.join(0.2)
    health.close()
    _close(server)
    if stopper.is_alive():
        # The deadline is the orchestrator's too (it kills after its grace period): exit now. Nothing
        # is lost: records not purged stay in the outbox and the next leader marks them again.
        log.error("reaper_stop_deadline", timeout_seconds=timeout, in_flight=harvester.in_flight_records)
        sys.stderr.flush()
        os._exit(1)
    if failed:
        log.error("reaper_stop_failed", exc_info=failed[0])
        return 1
    log.info("reaper_stopped")
    return 0


def start_error(exc: Exception) -> FailError:
    """Why ``Harvester.start()`` failed, as a one-line error naming the setting to look at."""
    import structlog

    from harvester.kafka.topics import TopicError
    from harvester.postgres.store import OutboxMissingError, ShardCountError, StoreError
    from leader.election import LeaderTopicError

    if isinstance(exc, ShardCountError):  # it names the setting and both numbers
        return FailError(str(exc))
    if isinstance(exc, TopicError):
        return FailError(f"harvest.checkpointTopic: {exc}")
    if isinstance(exc, OutboxMissingError):
        return FailError(f"harvest.outboxTable: {exc}")
    if isinstance(exc, StoreError):  # PostgreSQL unreachable, or a table of an unsupported layout
        return FailError(f"PostgreSQL (harvest.dataSource, harvest.outboxTable): {exc}")
    if isinstance(exc, LeaderTopicError):  # Kafka unreachable, or the topic absent and not creatable
        return FailError(f"harvest.leaderTopic: {exc}")
    structlog.get_logger("reaper").debug("start_failed", exc_info=exc)
    return FailError(f"cannot start: {type(exc).__name__}: {exc}", code=1)


def _narrower_columns(settings: ReaperSettings) -> list[Any]:
    """Columns of the dead-letter and staging tables narrower than the outbox's, as ``check`` reports
    them: a dead letter too wide for its table would stall the harvester (best effort, at start)."""
    import psycopg

    from harvester.postgres.widen import narrower

    try:
        with connect_pg(settings, 5) as conn:
            return [column for derived in narrower(conn, settings.harvest.table) for column in derived.narrower or []]
    except (FailError, psycopg.Error):
        return []  # the harvester itself reports the database's failures


def _close(server: HttpServer | None) -> None:
    if server is not None:
        server.close()


def _abandon(harvester: Harvester, server: HttpServer | None) -> None:
    """Best-effort cleanup after a failed start, so no background thread keeps the process alive."""
    _close(server)
    with contextlib.suppress(Exception):
        harvester.stop(1.0)

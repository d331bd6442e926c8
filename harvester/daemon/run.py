"""``reaper run``: the harvester as a daemon, with its HTTP endpoints, until a signal.

One path for every file: validate each harvest section, wait (bounded) for each section's Kafka (a
lone section not reached ends the process; one of several is retried in the background while the
others run), start one :class:`~harvester.daemon.outboxes.Outbox` per section, serve ``/metrics``,
``/healthz`` and ``/readyz`` over all of them, and on SIGTERM stop them all by one deadline,
``shutdown.timeout``."""

from __future__ import annotations

import errno
import faulthandler
import os
import signal
import sys
import threading
import time
from collections.abc import Callable, Sequence
from types import FrameType
from typing import TYPE_CHECKING, Any

import structlog

from harvester.daemon.check import (
    connect_pg,
    in_section,
    lacking_at_start,
    reach_kafka,
    validate_election,
    validate_kafka_config,
    validate_spill_directory,
)
from harvester.daemon.errors import FailError
from harvester.daemon.outboxes import Outbox, OutboxLabels, Probes, in_flight, leader_in_logs
from harvester.daemon.settings import ReaperSettings, defaulted_connections
from harvester.runtime import tune_garbage_collector

if TYPE_CHECKING:
    from prometheus_client import CollectorRegistry

    from harvester.daemon.http import HttpServer, Probe

log = structlog.get_logger("reaper")


class Signals:
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
        # ``received``, not ``stop.is_set()``: a second signal can land while the first handler is
        # inside ``stop.set()`` holding the event's lock, before the flag is set; handling it as a
        # first one would wait for that lock in the same thread for ever.
        if self.received is not None:
            # Nothing is lost: unacknowledged records stay marked in the outbox and the next leader
            # marks them again. os._exit skips the graceful path that is evidently stuck.
            os.write(2, f"reaper: second signal {signal.Signals(signum).name}: exiting now\n".encode())
            os._exit(128 + signum)
        self.received = signum
        self.stop.set()


def run(settings: ReaperSettings, version: str, announce: Callable[[int | None], None] | None = None) -> int:
    """Build one harvester per ``harvest:`` section and the HTTP endpoint, then serve until a signal.

    ``announce`` is told the HTTP port (None without HTTP) once every harvester started: a worker of
    ``reaper run --workers`` tells its supervisor (:mod:`harvester.daemon.workers`).

    A single section is the one-item case of a list: the same code runs it, except that it is not
    supervised (see :mod:`harvester.daemon.outboxes`): a failure to start, or its end, ends the process.
    """
    from prometheus_client import CollectorRegistry, Gauge

    # A crash inside a C library (librdkafka's assertions abort the process) prints every thread's
    # Python stack on stderr, so that it says what the process was doing. File descriptor 2 itself:
    # an in-process caller may have replaced sys.stderr with an object that has none (pytest's capsys).
    faulthandler.enable(file=2)
    sections = settings.sections
    several = len(sections) > 1
    validate(settings)
    for section in sections:  # said first: what follows may fail where a default led
        defaults = defaulted_connections(section)
        if defaults:
            where = {"outbox": section.harvest.table.qualified} if several else {}
            log.warning("connection_defaults", settings=defaults, hint=_SET_THEM, **where)
    waits: list[tuple[dict[str, Any], str | None]] = []  # each Kafka config, and why it was not reached
    unreachable: list[str | None] = []  # by section
    for index, section in enumerate(sections):  # one wait per Kafka cluster, at most startup.kafkaTimeout
        kafka = dict(section.harvest.base_kafka_config)
        known = [why for config, why in waits if config == kafka]
        if not known:
            known = [_wait_for_kafka(section, index if several else None)]
            waits.append((kafka, known[0]))
        unreachable.append(known[0])
    tune_garbage_collector()  # once the settings passed their checks: what is loaded now stays
    stop = threading.Event()
    on_event = None if several else leader_in_logs  # several terms run at once: no one leader id
    outboxes = [
        Outbox(section, stop, supervised=several, on_event=on_event, kafka_unreachable=why)
        for section, why in zip(sections, unreachable, strict=True)
    ]
    registry = CollectorRegistry()
    info = Gauge("reaper_info", "Always 1; labels describe this reaper.", ["version", "instance"], registry=registry)
    info.labels(version=version, instance=settings.harvest.name).set(1)
    registry.register(OutboxLabels(outboxes))
    probes = Probes(outboxes)
    server = listen(settings, registry, probes.liveness, probes.readiness) if settings.http.enabled else None
    if server is not None:
        server.start()
    signals = Signals()
    signals.install()
    try:
        try:
            for outbox in outboxes:
                outbox.start()
        except FailError:
            _close(server)
            raise
        _started(settings, version, outboxes, server)
        if announce is not None:
            announce(server.port if server else None)
        while not signals.stop.wait(0.5):
            ended = next((o for o in outboxes if o.ended.is_set()), None)
            if ended is not None:
                stop.set()
                _close(server)
                if ended.failure is not None:
                    raise FailError(ended.failure, code=1)
                log.error("harvester_ended_unexpectedly")
                return 1
        stop.set()
        name = signal.Signals(signals.received).name if signals.received else "signal"
        timeout = settings.shutdown.timeout.total_seconds()
        log.info("reaper_stopping", signal=name, timeout_seconds=timeout, in_flight=in_flight(outboxes))
        return _stop_all(outboxes, timeout, server)
    finally:
        signals.restore()


def _wait_for_kafka(section: ReaperSettings, index: int | None) -> str | None:
    """Wait for ``section``'s Kafka; why it was not reached, or None. A lone section (``index``
    None) that does not reach it ends the process: :class:`FailError`."""
    try:
        with in_section(index):
            reach_kafka(section, section.startup.kafka_timeout.total_seconds(), say_waiting=True)
            lacking_at_start(section, _ACCESS_TIMEOUT)
    except FailError as exc:
        if index is None:
            raise
        return str(exc)
    return None


def validate(settings: ReaperSettings) -> None:
    """Raise :class:`FailError` for a configuration mistake in any section, before anything starts."""
    sections = settings.sections
    for index, section in enumerate(sections):
        with in_section(index if len(sections) > 1 else None):
            validate_kafka_config(section)
            validate_election(section)
            validate_spill_directory(section)


def _started(settings: ReaperSettings, version: str, outboxes: list[Outbox], server: HttpServer | None) -> None:
    """Say what was started, and which tables are narrower than the outbox."""
    for outbox in outboxes:
        for column in _narrower_columns(outbox.settings):
            log.warning("narrower_than_outbox", column=str(column), **outbox.labels)
    where: dict[str, object] = {"outboxes": [o.name for o in outboxes]}
    if len(outboxes) == 1:
        harvest = settings.harvest
        where = {
            "table": harvest.table.qualified,
            "shards": harvest.shards,
            "group": harvest.group_id,
            "topic": harvest.topic,
        }
    log.info("reaper_started", version=version, **where, http_port=server.port if server else None)


def listen(settings: ReaperSettings, registry: CollectorRegistry, liveness: Probe, readiness: Probe) -> HttpServer:
    """Bind the HTTP endpoint; raise :class:`FailError` when it cannot listen.

    A port the configuration set (``http.port`` in the file, or ``REAPER_HTTP__PORT``) is used or
    refused. A defaulted port that is busy (another reaper on this host: goharvest's failover set-up,
    whose users never configured an HTTP port) gives way to a free port chosen by the OS, logged here
    and in ``reaper_started``.
    """
    from harvester.daemon.http import HttpServer

    http = settings.http

    def bind(port: int) -> HttpServer:
        return HttpServer(registry, host=http.host, port=port, liveness=liveness, readiness=readiness)

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
            log.warning(
                "http_port_in_use",
                default_port=http.port,
                http_port=server.port,
                reason=error.strerror,
                hint="set http.port (or REAPER_HTTP__PORT) to choose the port",
            )
            return server
    raise FailError(f"http.port: cannot listen on {http.host}:{http.port}: {error.strerror}") from None


_ACCESS_TIMEOUT = 10.0
"""Bound on each look-up of the ACLs and privileges at start."""

_STOP_TAIL = 2.0
"""Seconds of ``shutdown.timeout`` kept from the harvester's stop for closing the HTTP endpoint and
for the process's exit, where librdkafka's clients are destroyed (about a second with a broker down)."""

_SET_THEM = "set them in the file, or REAPER_HARVEST__*"

_BUSY = (errno.EADDRINUSE, errno.EACCES)
"""Bind errors after which a defaulted ``http.port`` falls back to a free one."""


def _narrower_columns(settings: ReaperSettings) -> list[Any]:
    """Columns of the dead-letter and staging tables narrower than the outbox's, as ``check`` reports
    them: a dead letter too wide for its table would stall the harvester (best effort, at start).
    None for a table-less outbox: its dead letters hold the raw payload's bytes."""
    import psycopg

    if settings.harvest.log_messages:
        return []

    from harvester.postgres.schema.widen import narrower

    try:
        with connect_pg(settings, 5) as conn:
            return [column for derived in narrower(conn, settings.harvest.table) for column in derived.narrower or []]
    except (FailError, psycopg.Error):
        return []  # the harvester itself reports the database's failures


def _close(server: HttpServer | None) -> None:
    if server is not None:
        server.close()


def _stop_all(outboxes: Sequence[Outbox], timeout: float, server: HttpServer | None) -> int:
    """Stop every outbox at once, all by one deadline ``timeout`` seconds from now, whatever state
    each is in; return the exit code. The stops run on threads of their own, so the main thread
    stays free to act on a second signal at once, even while a stop blocks inside librdkafka."""
    deadline = time.monotonic() + timeout
    budget = max(time.monotonic(), deadline - _STOP_TAIL)  # what the harvesters' stops may take
    failed: list[tuple[Outbox, BaseException]] = []

    def stop(outbox: Outbox) -> None:
        try:
            outbox.stop(budget)
        except Exception as exc:  # reported below, as a log line rather than a raw thread traceback
            failed.append((outbox, exc))

    stoppers = [threading.Thread(target=stop, args=(o,), name=f"reaper-stop-{o.name}", daemon=True) for o in outboxes]
    for stopper in stoppers:
        stopper.start()
    for stopper in stoppers:
        while stopper.is_alive() and time.monotonic() < deadline:
            stopper.join(0.2)
    _close(server)
    if any(stopper.is_alive() for stopper in stoppers):
        # The deadline is the orchestrator's too (it kills after its grace period): exit now. Nothing
        # is lost: records not purged stay in the outbox and the next leader marks them again.
        log.error("reaper_stop_deadline", timeout_seconds=timeout, in_flight=in_flight(outboxes))
        sys.stderr.flush()
        os._exit(1)
    for outbox, exc in failed:
        log.error("reaper_stop_failed", exc_info=exc, **outbox.labels)
    if failed:
        return 1
    log.info("reaper_stopped")
    return 0

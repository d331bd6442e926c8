"""``reaper run --workers N``: one supervisor process and N reaper processes, one core each.

The Python work of a harvester holds the GIL (docs/sharding.md), so the pipelines of one process
share about one core. With ``workers: N`` the process started becomes a small supervisor that starts
N ordinary ``reaper run`` processes of the same file, each with an instance name of its own
(``<name>-w<i>``) and so each a full, independent member of every leader group. The group
coordinator spreads the shards over all members, these included, and NELI with the per-shard epoch
fence keeps them safe against each other exactly as it keeps separate reapers safe: there is no
coordination here beyond starting, watching and stopping processes.

The supervisor restarts a worker that ends (with a back-off, saying why), forwards SIGTERM/SIGINT and
enforces ``shutdown.timeout`` over the whole stop, and serves the HTTP endpoint: each worker listens
on a free port of the loopback (written to a file of the supervisor's temporary directory once it
started), and the supervisor's ``/healthz`` and ``/readyz`` ask every worker, ``/metrics`` merges
every worker's series with a ``worker`` label, and adds its own count of each worker's restarts
(``harvester_worker_restarts_total``).
"""

from __future__ import annotations

import contextlib
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Iterator, Mapping
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

import structlog
from prometheus_client import CollectorRegistry
from prometheus_client.metrics_core import CounterMetricFamily, Metric
from prometheus_client.parser import text_string_to_metric_families
from prometheus_client.registry import Collector

from harvester.daemon.errors import FailError
from harvester.daemon.run import Signals, listen, validate
from harvester.daemon.settings import HttpSettings, ReaperSettings

log = structlog.get_logger("reaper")

FIRST_RESTART = 1.0
"""Seconds before a worker that ended is started again; doubled up to :data:`LAST_RESTART`, and
back to the first once a worker ran that long."""
LAST_RESTART = 30.0
ASK_TIMEOUT = 2.0
"""Bound on one request of the supervisor to a worker's endpoint; the workers are asked at once, so
it bounds a whole probe or scrape too, however many workers hang."""


def as_worker(settings: ReaperSettings, worker: str) -> tuple[ReaperSettings, Path]:
    """The settings of worker ``<index>:<supervisor pid>:<directory>`` (the hidden ``--worker``
    option): every section's instance name suffixed ``-w<index>``, HTTP on a free loopback port
    (only the supervisor asks it), one process; and the file its port is to be written to."""
    index, parent, directory = worker.split(":", 2)
    _die_with_parent(int(parent))
    http = HttpSettings(enabled=settings.http.enabled, host="127.0.0.1", port=0)
    sections = [
        s.model_copy(
            update={
                "harvest": s.harvest.model_copy(update={"name": f"{s.harvest.name}-w{index}"}),
                "http": http,
                "workers": 1,
            }
        )
        for s in settings.sections
    ]
    return sections[0].with_sections(sections[1:]), Path(directory) / f"worker-{index}.port"


def announce_to(path: Path) -> Callable[[int | None], None]:
    """What :func:`~harvester.daemon.run.run` calls with the worker's HTTP port once it started."""

    def announce(port: int | None) -> None:
        partial = path.with_suffix(".partial")
        partial.write_text("" if port is None else str(port), "utf-8")
        partial.replace(path)  # the supervisor never reads half a number

    return announce


def _die_with_parent(parent: int) -> None:
    """A worker gets SIGTERM when its supervisor dies (Linux), so no worker outlives it unseen."""
    if sys.platform.startswith("linux"):
        import ctypes

        ctypes.CDLL(None).prctl(1, signal.SIGTERM)  # PR_SET_PDEATHSIG
    if os.getppid() != parent:  # died before the line above
        os.kill(os.getpid(), signal.SIGTERM)


class Worker:
    """One child ``reaper run`` process, started again when it ends."""

    def __init__(self, index: int, command: list[str], directory: Path) -> None:
        self.index = index
        self._command = command
        self.port_file = directory / f"worker-{index}.port"
        self.proc: subprocess.Popen[bytes] | None = None
        self.port: int | None = None
        self.started = False  # announced its port once: its configuration and services were fine
        self.restarts = 0
        self._since = 0.0
        self._due = 0.0
        self._delay = FIRST_RESTART

    def start(self) -> None:
        self.port = None
        self.port_file.unlink(missing_ok=True)
        # A session of its own: a terminal's Ctrl-C reaches the supervisor only, which forwards it
        # once; a second signal straight to a worker would cut its graceful stop short.
        self.proc = subprocess.Popen(self._command, start_new_session=True)
        self._since = time.monotonic()
        log.info("worker_started", worker=self.index, pid=self.proc.pid, restarts=self.restarts)

    def tend(self) -> None:
        """Start this worker again when it ended and its back-off passed; learn its port."""
        now = time.monotonic()
        if self.proc is None:
            if now >= self._due:
                self.restarts += 1
                self.start()
            return
        code = self.proc.poll()
        if code is None:
            if self.port is None and self.port_file.exists():
                text = self.port_file.read_text("utf-8")
                self.port, self.started = (int(text) if text else None), True
                log.info("worker_listening", worker=self.index, pid=self.proc.pid, http_port=self.port)
            return
        if code == 2 and not self.started:
            # As one process would: a configuration mistake or a service unreachable at start is
            # one line (the worker's, above) and exit 2, not a restart loop.
            raise FailError(f"worker {self.index} could not start (exit 2): see its error above")
        if now - self._since >= LAST_RESTART:
            self._delay = FIRST_RESTART
        why = f"killed by {signal.Signals(-code).name}" if code < 0 else f"exit code {code}"
        log.error("worker_ended", worker=self.index, pid=self.proc.pid, reason=why, restart_in_seconds=self._delay)
        self.proc, self.port = None, None
        self._due = now + self._delay
        self._delay = min(self._delay * 2, LAST_RESTART)

    def ask(self, path: str) -> tuple[int, str]:
        """GET ``path`` of this worker's endpoint: status and body; ``(0, "")`` when it does not answer."""
        if self.port is None:
            return 0, ""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=ASK_TIMEOUT) as resp:
                return int(resp.status), resp.read().decode()
        except urllib.error.HTTPError as err:
            return int(err.code), err.read().decode()
        except OSError:
            return 0, ""


def ask_all(workers: list[Worker], path: str) -> list[tuple[int, str]]:
    """:meth:`Worker.ask` of every worker at once, in the workers' order."""
    with ThreadPoolExecutor(max_workers=max(1, len(workers)), thread_name_prefix="ask") as pool:
        return list(pool.map(lambda w: w.ask(path), workers))


class WorkerProbes:
    """``/healthz`` and ``/readyz`` over the workers, asked at each request."""

    def __init__(self, workers: list[Worker]) -> None:
        self._workers = workers

    def _each(self, path: str) -> Iterator[tuple[Worker, int, dict[str, object]]]:
        for w, (status, body) in zip(self._workers, ask_all(self._workers, path), strict=True):
            try:
                details = json.loads(body) if body else {}
            except ValueError:
                details = {}
            yield w, status, {"pid": w.proc.pid if w.proc else None, **details}

    def liveness(self) -> tuple[bool, Mapping[str, object]]:
        """Alive when every worker that started answers alive; a worker being restarted is the
        supervisor's to mend, not a reason to kill the pod."""
        each = {str(w.index): (w.port is None or status == 200, d) for w, status, d in self._each("/healthz")}
        return all(ok for ok, _ in each.values()), {"workers": {i: d for i, (_, d) in each.items()}}

    def readiness(self) -> tuple[bool, Mapping[str, object]]:
        """Ready when every worker is; ``leading_shards`` is the union of theirs."""
        each = {str(w.index): (status == 200, d) for w, status, d in self._each("/readyz")}
        shards = sorted({s for _, d in each.values() for s in _ints(d.get("leading_shards"))})
        leading = any(bool(d.get("is_leader")) for _, d in each.values())
        details = {"is_leader": leading, **({"leading_shards": shards} if shards else {})}
        return all(ok for ok, _ in each.values()), {**details, "workers": {i: d for i, (_, d) in each.items()}}


def _ints(value: object) -> list[int]:
    return [int(v) for v in value if isinstance(v, int)] if isinstance(value, list) else []


class WorkerMetrics(Collector):
    """Every worker's series, scraped when the supervisor is, with a ``worker`` label; and the
    supervisor's count of each worker's restarts, which no worker can report (it starts at 0 again)."""

    def __init__(self, workers: list[Worker]) -> None:
        self._workers = workers

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for w, (status, body) in zip(self._workers, ask_all(self._workers, "/metrics"), strict=True):
            if status != 200:
                continue
            for family in text_string_to_metric_families(body):
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for s in family.samples:
                    out.add_sample(s.name, {"worker": str(w.index), **s.labels}, s.value, s.timestamp, s.exemplar)
        yield from merged.values()
        about = "Times the supervisor started a worker again after it ended."
        restarts = CounterMetricFamily("harvester_worker_restarts", about, labels=["worker"])
        for w in self._workers:
            restarts.add_metric([str(w.index)], w.restarts)
        yield restarts


def port_directory() -> Path:
    """A new directory for the workers' port files, in the system's temporary directory (``TMPDIR``,
    else ``/tmp``, ...); :class:`FailError` naming ``TMPDIR`` when none is writable (a container's
    read-only root filesystem)."""
    try:
        return Path(tempfile.mkdtemp(prefix="reaper-workers-"))
    except OSError as exc:
        raise FailError(
            f"workers: cannot make the workers' directory in the temporary directory ({exc.strerror or exc}):"
            " set TMPDIR to a writable directory (an emptyDir volume on a read-only root filesystem)"
        ) from None


def supervise(settings: ReaperSettings, file: str | None, count: int) -> int:
    """Run ``count`` workers of ``file`` until a signal; return the exit code."""
    validate(settings)
    directory = port_directory()
    base = [sys.executable, "-m", "harvester.daemon.cli", "run", *(["-f", file] if file else [])]
    workers = [Worker(i, [*base, "--worker", f"{i}:{os.getpid()}:{directory}"], directory) for i in range(count)]
    signals = Signals()
    signals.install()
    server = None
    try:
        if settings.http.enabled:
            registry = CollectorRegistry()
            registry.register(WorkerMetrics(workers))
            probes = WorkerProbes(workers)
            server = listen(settings, registry, probes.liveness, probes.readiness)
            server.start()
        for w in workers:
            w.start()
        log.info(
            "reaper_started",
            workers=count,
            pids=[w.proc.pid for w in workers if w.proc],
            http_port=server.port if server else None,
        )
        try:
            while not signals.stop.wait(0.2):
                for w in workers:
                    w.tend()
        except FailError:
            stop_workers(workers, signal.SIGTERM, settings.shutdown.timeout.total_seconds())
            raise
        name = signal.Signals(signals.received or signal.SIGTERM)
        timeout = settings.shutdown.timeout.total_seconds()
        log.info("reaper_stopping", signal=name.name, timeout_seconds=timeout, workers=count)
        code = stop_workers(workers, name, timeout)
        if code == 0:
            log.info("reaper_stopped")
        return code
    finally:
        if server is not None:
            server.close()
        signals.restore()
        shutil.rmtree(directory, ignore_errors=True)


def stop_workers(workers: list[Worker], sig: signal.Signals, timeout: float) -> int:
    """Forward ``sig`` to every worker and wait for all by one deadline ``timeout`` seconds from now;
    a worker still running then is killed (exit 1, as one process exits past its deadline). Each
    worker enforces the same deadline on itself; the kill is for one that cannot."""
    deadline = time.monotonic() + timeout
    running = [w.proc for w in workers if w.proc is not None]
    for proc in running:
        with contextlib.suppress(ProcessLookupError):
            proc.send_signal(sig)
    codes = []
    for proc in running:
        try:
            codes.append(proc.wait(max(0.0, deadline - time.monotonic())))
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()
            log.error("reaper_stop_deadline", timeout_seconds=timeout, worker_pid=proc.pid)
            codes.append(1)
    failed = [c for c in codes if c != 0]
    if failed:
        log.error("workers_stopped_with_errors", exit_codes=codes)
    return 1 if failed else 0

"""The competing harvester processes of a run, kept at full strength."""

from __future__ import annotations

import os
import signal
import time
from contextlib import suppress
from pathlib import Path
from typing import Any

from harvester.postgres.schema.identifiers import TableName
from tests.chaos.settings import ChaosSettings
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.names import unique

LEADERSHIP = ("LeaderAcquired", "LeaderRevoked", "LeaderFenced")
# A table-less outbox accepts to lose what a failover would lose: the private PostgreSQL 15 has no
# failover slots (docs/log-source.md, "Failover").
ACCEPT_LOSS_ON_FAILOVER: dict[str, Any] = {"logAcceptLossOnFailover": True}


class HarvesterGroup:
    """The competing harvester processes (``tests/proc/run_harvester.py``), kept at full strength."""

    def __init__(self, settings: ChaosSettings, dsn: str, outbox: TableName, bootstrap: str) -> None:
        self._settings = settings
        self._dsn = dsn
        self._outbox = outbox
        self._bootstrap = bootstrap
        self._group_id = unique("chaos-leader")
        self._started = 0
        self.running: list[HarvesterProcess] = []
        self.retired: list[HarvesterProcess] = []
        self.crashes: list[str] = []
        self.refused_starts = 0  # processes replaced because a service under a fault refused their start

    def spec(self, name: str) -> dict[str, Any]:
        """The run_harvester JSON spec of one process."""
        s = self._settings
        return harvester_spec(
            self._dsn,
            self._bootstrap,
            self._outbox,
            self._group_id,
            name,
            session_timeout=s.session_timeout,
            delivery=s.delivery,
            shards=s.shards,
            source=s.source,
            **({"log_messages": True} if s.log_messages else {}),
            **({"key_release": s.key_release} if s.key_release else {}),
            **(
                {"layout": "debezium", "event_router": {"route.topic.replacement": "${routedByValue}"}}
                if s.layout == "debezium"
                else {}
            ),
            **({"log_retention": f"{int(s.log_retention * 1000)}ms"} if s.log_retention else {}),
            **(ACCEPT_LOSS_ON_FAILOVER if s.log_messages else {}),
            # The large transactions' records past about 100 (of large_txn) are spilled, under every fault.
            **({"log_transaction_memory": 64 * 1024} if s.source == "log" else {}),
            limits={
                "heartbeat_timeout": f"{int(s.heartbeat_timeout * 1000)}ms",
                "io_error_backoff": "200ms",
                # Bounds how long a revoked leader waits for in-flight records while Kafka is away.
                "drain_interval": "5s",
            },
        )

    def start(self) -> None:
        """Start the configured number of processes."""
        for _ in range(self._settings.harvesters):
            self._spawn()

    def _spawn(self) -> HarvesterProcess:
        self._started += 1
        proc = HarvesterProcess(self.spec(f"chaos-h{self._started}"))
        self.running.append(proc)
        return proc

    def replace(self, proc: HarvesterProcess) -> HarvesterProcess:
        """Retire a process that has exited and start a successor."""
        self.running.remove(proc)
        self.retired.append(proc)
        return self._spawn()

    def replace_crashed(self) -> None:
        """Replace any process that exited without being killed (recorded as a crash, unless a
        service under a fault refused its start, as a restarted database does)."""
        for proc in list(self.running):
            code = proc.proc.poll()
            if code is not None and proc.refused_start():
                self.refused_starts += 1
                self.replace(proc)
            elif code is not None:
                tail = "".join([line for line in list(proc.log) if not line.startswith("%")][-5:]).strip()
                self.crashes.append(f"{proc.name} exited with {code}: {tail}")
                self.replace(proc)

    def leader(self) -> HarvesterProcess | None:
        """The running process that leads a shard under the latest LeaderAcquired of any shard it leads."""
        best: tuple[float, HarvesterProcess] | None = None
        for proc in self.running:
            if proc.proc.poll() is not None:
                continue
            latest: dict[int, dict[str, Any]] = {}
            for e in list(proc.events):
                if e["event"] in LEADERSHIP:
                    latest[int(e.get("shard", 0))] = e
            acquired = [e["t"] for e in latest.values() if e["event"] == "LeaderAcquired"]
            if acquired and (best is None or max(acquired) > best[0]):
                best = (max(acquired), proc)
        return None if best is None else best[1]

    def wait_leader(self, timeout: float) -> HarvesterProcess | None:
        """Wait up to ``timeout`` for a leader."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            found = self.leader()
            if found is not None:
                return found
            time.sleep(0.1)
        return None

    def acquisitions(self) -> int:
        """LeaderAcquired events over all processes, retired ones included."""
        return sum(1 for p in self.running + self.retired for e in list(p.events) if e["event"] == "LeaderAcquired")

    def timeline(self, started: float) -> list[str]:
        """Every process's events (start, leadership, exit), in time order; ``started`` is wall time."""
        sharded = self._settings.shards > 1
        events = [
            (e["t"], p.name, e["event"] + (f" shard {e['shard']}" if sharded and "shard" in e else ""))
            for p in self.running + self.retired
            for e in list(p.events)
        ]
        return [f"{t - started:7.1f}s  {name:<10} {event}" for t, name, event in sorted(events)]

    def save_logs(self, directory: Path) -> None:
        """Write every process's output (librdkafka's own lines left out) to ``<directory>/<name>.log``."""
        directory.mkdir(parents=True, exist_ok=True)
        for p in self.running + self.retired:
            text = "".join(line for line in list(p.log) if not line.startswith("%"))
            (directory / f"{p.name}.log").write_text(text)

    def log_tails(self, lines: int, retired: bool = False) -> dict[str, list[str]]:
        """The last ``lines`` log lines of each running process (and with ``retired`` of those that
        ended), librdkafka's own lines left out."""
        procs = self.running + (self.retired if retired else [])
        return {p.name: [line.rstrip() for line in list(p.log) if not line.startswith("%")][-lines:] for p in procs}

    def stop(self) -> None:
        """SIGTERM every process at once (each stops gracefully), then wait for them."""
        for proc in self.running:
            with suppress(ProcessLookupError):
                os.kill(proc.proc.pid, signal.SIGCONT)  # a stopped process cannot handle SIGTERM
            if proc.proc.poll() is None:
                proc.proc.terminate()
        for proc in self.running + self.retired:
            proc.terminate(timeout=30)

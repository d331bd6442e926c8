"""Start and watch harvester processes (tests/proc/run_harvester.py)."""

from __future__ import annotations

import json
import signal
import subprocess
import sys
import threading
import time
from typing import Any

import psycopg

from harvester.postgres.schema.identifiers import TableName
from tests.support.paths import ROOT

# run_harvester's exit code when PostgreSQL or Kafka refused its start (printed as ``start_refused``).
START_REFUSED = 3


class HarvesterProcess:
    """One harvester process; its JSON event lines are collected as they arrive."""

    def __init__(self, spec: dict[str, Any]) -> None:
        self.name = str(spec["name"])
        self.events: list[dict[str, Any]] = []
        self.log: list[str] = []
        self.proc = subprocess.Popen(
            [sys.executable, "-m", "tests.proc.run_harvester", json.dumps(spec)],
            cwd=ROOT,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            if line.startswith("{"):
                try:
                    self.events.append(json.loads(line))
                    continue
                except json.JSONDecodeError:
                    pass
            self.log.append(line)

    def refused_start(self) -> bool:
        """Whether the process exited because a service it needs refused its start."""
        if self.proc.poll() != START_REFUSED:
            return False
        self._reader.join(5)  # its last line may still be on its way to the reader thread
        return self.seen("start_refused")

    def seen(self, event: str, after: float = 0.0) -> bool:
        return any(e["event"] == event and e["t"] >= after for e in list(self.events))

    def wait_for(self, event: str, timeout: float = 30.0, after: float = 0.0) -> bool:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.seen(event, after):
                return True
            time.sleep(0.05)
        return False

    def terminate(self, timeout: float = 30.0) -> dict[str, Any] | None:
        """SIGTERM, wait, and return the final counters line (None if it did not exit cleanly)."""
        if self.proc.poll() is None:
            self.proc.terminate()
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                # Where it is stuck goes to its log (run_harvester registers SIGUSR1 with faulthandler).
                self.proc.send_signal(signal.SIGUSR1)
                time.sleep(1.0)
                self.proc.kill()
                self.proc.wait()
        self._reader.join(5)
        return next((e for e in self.events if e["event"] == "exit"), None)


def harvester_spec(
    dsn: str, bootstrap: str, table: TableName, group: str, name: str, **settings: Any
) -> dict[str, Any]:
    """A run_harvester spec with the short failover timings the process tests use; ``settings``
    (HarvesterConfig fields; ``limits`` is merged) override it."""
    limits = {"heartbeat_timeout": "2s", **settings.pop("limits", {})}
    return {
        "data_source": dsn,
        "outbox_table": table.qualified,
        "base_kafka_config": {"bootstrap.servers": bootstrap},
        "leader_group_id": group,
        "name": name,
        "session_timeout": 3.0,
        "limits": limits,
        **settings,
    }


def blocked_statement(dsn: str, name: str) -> tuple[int, str] | None:
    """The server pid and text of harvester process ``name``'s statement that waits for a lock, if
    one does (a test holding a lock stops a process at a known point)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            "SELECT pid, query FROM pg_stat_activity WHERE application_name = %s AND wait_event_type = 'Lock'",
            (f"outbox-harvester {name}",),
        ).fetchone()
    return None if row is None else (int(str(row[0])), str(row[1]))

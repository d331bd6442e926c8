"""The fault injector: leaders killed and paused, the broker and the database restarted,
connections terminated."""

from __future__ import annotations

import os
import random
import signal
import time
from collections import Counter
from dataclasses import dataclass

import psycopg

from tests.chaos.harvesters import HarvesterGroup
from tests.chaos.settings import FAULT_WEIGHTS, ChaosSettings, Log
from tests.support.private_services import PrivateKafka, PrivatePostgres


@dataclass(frozen=True)
class Fault:
    """One injected fault."""

    at: float  # seconds since the writers started
    kind: str
    target: str
    detail: str
    seconds: float  # time taken to inject it and undo it

    def __str__(self) -> str:
        return f"{self.at:7.1f}s  {self.kind:<22} {self.target:<10} {self.detail} ({self.seconds:.1f}s)"


class FaultInjector:
    """Injects faults at random times until ``fault_seconds`` passed and every kind ran once."""

    def __init__(
        self,
        settings: ChaosSettings,
        group: HarvesterGroup,
        pg: PrivatePostgres,
        kafka: PrivateKafka,
        log: Log,
    ) -> None:
        self._settings = settings
        self._rng = random.Random(f"{settings.seed}/faults")
        self._group = group
        self._pg = pg
        self._kafka = kafka
        self._log = log
        self.faults: list[Fault] = []
        self.skipped: Counter[str] = Counter()

    def run(self, started: float) -> None:
        """Inject faults; return when done. ``started`` is the writers' start (monotonic)."""
        s, rng = self._settings, self._rng
        pending = set(s.faults)  # kinds not injected yet: drawn first, so each runs at least once
        # A kind that keeps being skipped (no leader found) must not prolong the run forever; the
        # bound leaves room for a broker restart of minutes on a loaded machine in a short window.
        give_up = started + 2 * s.fault_seconds + 180
        while (time.monotonic() - started < s.fault_seconds or pending) and time.monotonic() < give_up:
            time.sleep(rng.uniform(s.min_gap, s.max_gap))
            kinds = sorted(pending) if pending else list(s.faults)
            kind = rng.choices(kinds, [FAULT_WEIGHTS[k] for k in kinds])[0]
            pause = rng.uniform(s.heartbeat_timeout + 0.5, s.session_timeout + 3.0)  # drawn for every kind: replayable
            at = time.monotonic()
            outcome = self._inject(kind, pause)
            if outcome is None:
                self.skipped[kind] += 1
                self._log(f"{at - started:7.1f}s  {kind:<22} skipped: no leader")
            else:
                fault = Fault(at - started, kind, outcome[0], outcome[1], time.monotonic() - at)
                self.faults.append(fault)
                pending.discard(kind)
                self._log(str(fault))
            self._group.replace_crashed()

    def _inject(self, kind: str, pause: float) -> tuple[str, str] | None:
        """Inject one fault and undo it; (target, detail), or None when there was no leader to hit."""
        if kind == "restart_kafka":
            self._kafka.restart()
            return "kafka", "broker restarted"
        if kind == "restart_postgres":
            self._pg.restart()
            return "postgres", "fast shutdown and start"
        if kind == "terminate_connections":
            with psycopg.connect(self._pg.dsn, autocommit=True, application_name="chaos-injector") as conn:
                row = conn.execute(
                    "SELECT count(pg_terminate_backend(pid)) FROM pg_stat_activity WHERE application_name LIKE %s",
                    ("outbox-harvester%",),
                ).fetchone()
            return "postgres", f"{row[0] if row else 0} harvester connections terminated"
        leader = self._group.wait_leader(20.0)
        if leader is None:
            return None
        if kind == "kill_leader":
            os.kill(leader.proc.pid, signal.SIGKILL)
            leader.proc.wait()
            successor = self._group.replace(leader)
            return leader.name, f"SIGKILL, {successor.name} started"
        if kind == "stop_leader":
            os.kill(leader.proc.pid, signal.SIGSTOP)
            try:
                time.sleep(pause)
            finally:
                os.kill(leader.proc.pid, signal.SIGCONT)
            return leader.name, f"SIGSTOP for {pause:.1f}s, then SIGCONT"
        raise ValueError(f"unknown fault kind {kind!r}")

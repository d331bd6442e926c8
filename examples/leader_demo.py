"""A competing process that prints its leadership as JSON lines, and a driver for a group of them.

Run one by hand to watch an election (start several in other terminals, then stop or kill them)::

    python -m examples.leader_demo --bootstrap 127.0.0.1:9092 --group demo

Each stdout line is a JSON object with ``t`` (``time.monotonic()``, comparable between processes on one
host), ``pid``, ``event`` and, where relevant, ``leader_id``. Events: ``ready``, ``acquired``,
``revoked``, ``revoke_done``, ``fenced``, ``work`` (one unit of leader work, done only after checking
:attr:`NeliElector.status`), ``closing`` and ``closed``. SIGTERM closes the elector gracefully.

:class:`Competitor` starts such a process and collects its lines; the integration tests and
``bench/failover.py`` build their scenarios from it.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Sequence
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any
from uuid import UUID

from leader.config import ElectorConfig
from leader.election import NeliElector
from leader.events import LeaderAcquired, LeaderEvent, LeaderFenced, LeaderRevoked

Line = dict[str, Any]


@dataclass(frozen=True)
class DemoSettings:
    """Election timing of a demo process, in seconds."""

    heartbeat_interval: float = 0.5
    heartbeat_timeout: float = 2.0
    session_timeout: float = 3.0
    group_heartbeat_interval: float = 0.5
    min_poll_interval: float = 0.1
    max_poll_interval: float = 30.0
    revoke_delay: float = 0.0
    work_interval: float = 0.1

    def args(self) -> list[str]:
        """Command-line arguments of ``python -m examples.leader_demo`` for these settings."""
        return [part for key, value in asdict(self).items() for part in (f"--{key.replace('_', '-')}", str(value))]


class _Printer:
    def __init__(self) -> None:
        self._lock = threading.Lock()

    def __call__(self, event: str, t: float | None = None, **fields: Any) -> None:
        line = {"t": time.monotonic() if t is None else t, "pid": os.getpid(), "event": event, **fields}
        with self._lock:
            sys.stdout.write(json.dumps(line) + "\n")
            sys.stdout.flush()


def main(argv: Sequence[str] | None = None) -> None:
    """Compete for leadership until SIGTERM or SIGINT, printing events and work as JSON lines."""
    parser = argparse.ArgumentParser(prog="python -m examples.leader_demo", description=__doc__.split("\n")[0])
    parser.add_argument("--bootstrap", default="127.0.0.1:9092")
    parser.add_argument("--group", required=True)
    for key, value in asdict(DemoSettings()).items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=float, default=value)
    ns = parser.parse_args(argv)
    settings = DemoSettings(**{key: getattr(ns, key) for key in asdict(DemoSettings())})
    out = _Printer()
    elector = NeliElector(
        ElectorConfig(
            kafka_config={"bootstrap.servers": ns.bootstrap},
            group_id=ns.group,
            heartbeat_interval=settings.heartbeat_interval,
            heartbeat_timeout=settings.heartbeat_timeout,
            session_timeout=settings.session_timeout,
            group_heartbeat_interval=settings.group_heartbeat_interval,
            min_poll_interval=settings.min_poll_interval,
            max_poll_interval=settings.max_poll_interval,
        )
    )
    current: list[UUID | None] = [None]

    def on_event(event: LeaderEvent) -> None:
        if isinstance(event, LeaderAcquired):
            current[0] = event.leader_id
            out("acquired", leader_id=str(event.leader_id))
        elif isinstance(event, LeaderFenced):
            current[0] = None
            out("fenced", leader_id=str(event.leader_id))
        elif isinstance(event, LeaderRevoked):
            current[0] = None
            out("revoked", leader_id=str(event.leader_id))
            # Stands for wrapping up in-flight work; partition 0 is released afterwards.
            time.sleep(settings.revoke_delay)
            out("revoke_done", leader_id=str(event.leader_id))

    stop = threading.Event()
    signal.signal(signal.SIGTERM, lambda *_: stop.set())
    signal.signal(signal.SIGINT, lambda *_: stop.set())
    elector.start(on_event)
    out("ready", group=ns.group, settings=asdict(settings))
    while not stop.wait(settings.work_interval):
        # Taken before the check, so a line printed late (after a freeze) still carries the check's time.
        t = time.monotonic()
        status, mine = elector.status, current[0]
        if mine is not None and status.is_leader and status.leader_id == mine:
            out("work", t=t, leader_id=str(mine))
    out("closing")
    elector.close()
    out("closed")


class Competitor:
    """A ``python -m examples.leader_demo`` child process and the lines it printed."""

    def __init__(self, bootstrap: str, group: str, settings: DemoSettings) -> None:
        root = str(Path(__file__).resolve().parent.parent)
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [root, os.environ.get("PYTHONPATH")]))}
        self.settings = settings
        self.ended_at: float | None = None
        self.stderr: list[str] = []
        self._lines: list[Line] = []
        self._cond = threading.Condition()
        argv = [sys.executable, "-m", "examples.leader_demo", "--bootstrap", bootstrap, "--group", group]
        self.proc = subprocess.Popen(
            [*argv, *settings.args()],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
            env=env,
        )
        threading.Thread(target=self._read_stdout, daemon=True).start()
        threading.Thread(target=self._read_stderr, daemon=True).start()

    @property
    def pid(self) -> int:
        """The process id."""
        return self.proc.pid

    def _read_stdout(self) -> None:
        assert self.proc.stdout is not None
        for raw in self.proc.stdout:
            try:
                line = json.loads(raw)
            except json.JSONDecodeError:
                continue
            with self._cond:
                self._lines.append(line)
                self._cond.notify_all()
        with self._cond:
            if self.ended_at is None:
                self.ended_at = time.monotonic()
            self._cond.notify_all()

    def _read_stderr(self) -> None:
        assert self.proc.stderr is not None
        for raw in self.proc.stderr:
            self.stderr.append(raw.rstrip())
            del self.stderr[:-200]

    def lines(self, event: str | None = None, since: float = float("-inf")) -> list[Line]:
        """Lines printed so far, optionally only of one ``event`` kind and with ``t`` after ``since``."""
        with self._cond:
            return [x for x in self._lines if (event is None or x["event"] == event) and x["t"] > since]

    def wait_for(self, predicate: Callable[[Line], bool], timeout: float) -> Line | None:
        """The first line (already printed or yet to come) that satisfies ``predicate``, or ``None``."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while True:
                found = next((x for x in self._lines if predicate(x)), None)
                left = deadline - time.monotonic()
                if found is not None or left <= 0:
                    return found
                self._cond.wait(left)

    @property
    def alive(self) -> bool:
        """Whether the process may still act: running and not killed by us."""
        return self.ended_at is None and self.proc.poll() is None

    @property
    def leading(self) -> bool:
        """Whether the process, by its own last report, is leader now."""
        with self._cond:
            terms = [x for x in self._lines if x["event"] in ("acquired", "revoked", "fenced")]
        return self.alive and bool(terms) and terms[-1]["event"] == "acquired"

    def signal(self, sig: signal.Signals) -> float:
        """Send ``sig``; returns the monotonic time just before sending."""
        t = time.monotonic()
        if sig == signal.SIGKILL:
            self.ended_at = t
        self.proc.send_signal(sig)
        return t

    def stop(self, timeout: float = 15.0) -> None:
        """End the process: SIGCONT (in case it is frozen), SIGTERM, and SIGKILL if it lingers."""
        if self.proc.poll() is None:
            self.proc.send_signal(signal.SIGCONT)
            self.proc.send_signal(signal.SIGTERM)
            try:
                self.proc.wait(timeout)
            except subprocess.TimeoutExpired:
                self.proc.kill()
                self.proc.wait()
        if self.ended_at is None:
            self.ended_at = time.monotonic()

    def terms(self, until: float) -> list[tuple[float, float]]:
        """Intervals during which the process believed itself leader (open ones end at ``until`` or its end)."""
        out: list[tuple[float, float]] = []
        start: float | None = None
        for x in self.lines():
            if x["event"] == "acquired" and start is None:
                start = x["t"]
            elif x["event"] in ("revoked", "fenced") and start is not None:
                out.append((start, x["t"]))
                start = None
        if start is not None:
            out.append((start, min(until, self.ended_at) if self.ended_at is not None else until))
        return out

    def describe(self) -> str:
        """The process's lines (without work) and stderr tail, for assertion messages."""
        events = [x for x in self.lines() if x["event"] != "work"]
        return f"pid {self.pid}: {events}\nstderr tail: {self.stderr[-20:]}"


def leaders(group: Sequence[Competitor]) -> list[Competitor]:
    """The members that currently report themselves leader."""
    return [c for c in group if c.leading]


def wait_single_leader(group: Sequence[Competitor], timeout: float, settle: float = 1.0) -> Competitor:
    """Wait until exactly one member has reported itself leader, unchanged for ``settle`` seconds."""
    deadline = time.monotonic() + timeout
    candidate: Competitor | None = None
    since = 0.0
    while time.monotonic() < deadline:
        now_leading = leaders(group)
        current = now_leading[0] if len(now_leading) == 1 else None
        if current is not candidate:
            candidate, since = current, time.monotonic()
        elif candidate is not None and time.monotonic() - since >= settle:
            return candidate
        time.sleep(0.05)
    raise TimeoutError("no single stable leader:\n" + "\n".join(c.describe() for c in group))


def wait_new_leader(
    group: Sequence[Competitor], since: float, timeout: float, exclude: Competitor | None = None
) -> tuple[Competitor, float]:
    """The first member other than ``exclude`` that acquired leadership after ``since``, and when."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        found = [(x["t"], c) for c in group if c is not exclude for x in c.lines("acquired", since)]
        if found:
            t, c = min(found, key=lambda pair: pair[0])
            return c, t
        time.sleep(0.02)
    raise TimeoutError("no new leader:\n" + "\n".join(c.describe() for c in group))


def max_overlap(group: Sequence[Competitor], until: float) -> float:
    """The longest continuous time during which two or more members believed themselves leader."""
    return longest_overlap([c.terms(until) for c in group])


def longest_overlap(terms: Sequence[Sequence[tuple[float, float]]]) -> float:
    """The longest continuous time covered by two or more of the intervals (one list per member)."""
    edges = sorted((t, step) for member in terms for start, end in member for t, step in ((start, 1), (end, -1)))
    longest, count, opened = 0.0, 0, 0.0
    for t, step in edges:
        if count < 2 <= count + step:
            opened = t
        elif count >= 2 > count + step:
            longest = max(longest, t - opened)
        count += step
    return longest


if __name__ == "__main__":
    main()

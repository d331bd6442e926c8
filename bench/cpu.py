"""CPU seconds spent by this process (the harvester, in-process) and by the PostgreSQL server, so a
benchmark can report what each record costs on both sides.

PostgreSQL's share is read from /proc: the postmaster (whose children's time, once they exit, is
added to its own ``cutime``/``cstime``) and every live child of it. Only the server this benchmark
connects to is counted, not other PostgreSQL instances on the machine.
"""

from __future__ import annotations

import contextlib
import gc
import os
import time
from collections import defaultdict
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg

_TICK = os.sysconf("SC_CLK_TCK")


def proc_stat(pid: int) -> list[str] | None:
    """The fields of /proc/PID/stat from ``state`` on (None once the process is gone)."""
    try:
        text = Path(f"/proc/{pid}/stat").read_text()
    except OSError:
        return None
    return text[text.rindex(")") + 2 :].split()  # fields from "state" on; comm may hold spaces


def process_age(pid: int) -> float | None:
    """Seconds since ``pid`` started (None once it is gone)."""
    fields = proc_stat(pid)
    if fields is None:
        return None
    # starttime, field 22 of stat, is 19 here: clock ticks after boot, as /proc/uptime counts seconds.
    started = int(fields[19]) / os.sysconf("SC_CLK_TCK")
    return float(Path("/proc/uptime").read_text().split()[0]) - started


def cpu_seconds(fields: list[str], children: bool) -> float:
    """CPU seconds in ``proc_stat`` fields: user + system, and with ``children`` its reaped children's."""
    # utime, stime, cutime, cstime are fields 14-17 of stat, 11-14 here (state is field 3).
    ticks = int(fields[11]) + int(fields[12])
    if children:
        ticks += int(fields[13]) + int(fields[14])
    return ticks / _TICK


def process_seconds(pid: int) -> float:
    """CPU seconds process ``pid`` has used so far (0 once it is gone)."""
    fields = proc_stat(pid)
    return cpu_seconds(fields, children=False) if fields else 0.0


def librdkafka_seconds(pid: int) -> float:
    """CPU seconds of process ``pid``'s librdkafka threads (named ``rdk:...``): native threads that
    never take the GIL. The rest of a reaper's CPU is spent on threads that run Python (holding the
    GIL except while psycopg or confluent-kafka wait on I/O)."""
    total = 0.0
    for task in Path(f"/proc/{pid}/task").glob("*"):
        try:
            if not (task / "comm").read_text().startswith("rdk:"):
                continue
            text = (task / "stat").read_text()
        except OSError:
            continue
        total += cpu_seconds(text[text.rindex(")") + 2 :].split(), children=False)
    return total


# Children of this process that are not the in-process harvester's (bench/peers.py's Kafka Connect
# worker): left out of own_seconds and of rss.own_pids.
NOT_OURS: set[int] = set()


def tree_seconds(root: int) -> float:
    """CPU seconds of process ``root`` and of every live process under it, each with its reaped
    children's (a Spark JVM's Python workers, forked and reaped by its ``pyspark.daemon``)."""
    parents: dict[int, int] = {}
    stats: dict[int, list[str]] = {}
    for entry in Path("/proc").iterdir():
        if entry.name.isdigit() and (fields := proc_stat(int(entry.name))) is not None:
            parents[int(entry.name)] = int(fields[1])
            stats[int(entry.name)] = fields
    total = 0.0
    for pid, fields in stats.items():
        up = pid
        while up not in (root, 0, 1) and up in parents:
            up = parents[up]
        if up == root:
            total += cpu_seconds(fields, children=True)
    return total


def own_children() -> list[int]:
    """The live children of this process but those in NOT_OURS: the log source's producer process."""
    me = os.getpid()
    return [
        pid
        for entry in Path("/proc").iterdir()
        if entry.name.isdigit()
        and (pid := int(entry.name)) not in NOT_OURS
        and (fields := proc_stat(pid)) is not None
        and int(fields[1]) == me
    ]


def own_seconds() -> float:
    """CPU seconds of this process and of its live children (own_children): the harvester
    in-process, with the producer process the log source starts (harvester.kafka.process_publisher)."""
    total = time.process_time()
    for pid in own_children():
        if (fields := proc_stat(pid)) is not None:
            total += cpu_seconds(fields, children=False)
    return total


def backend_pid(conn: psycopg.Connection[Any]) -> int:
    """The server process of ``conn``."""
    row = conn.execute("SELECT pg_backend_pid()").fetchone()
    assert row is not None
    return int(str(row[0]))


def _command(pid: int) -> bytes:
    """The command line of ``pid`` (a PostgreSQL backend's is its process title); empty once gone."""
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes()
    except OSError:
        return b""


# What a server process is, by a word of its process title ("postgres: walsender ...", "postgres:
# checkpointer", "postgres: autovacuum worker ..."); any other child of the postmaster is a session.
_KINDS = (b"walsender", b"checkpointer", b"walwriter", b"background writer", b"autovacuum", b"logical replication")


def postgres_kind(command: bytes) -> str:
    """The kind of the PostgreSQL server process whose command line is ``command``: one of the
    words of ``_KINDS``, else ``backend`` (a client's session)."""
    title = b" " + command.replace(b"\0", b" ") + b" "
    return next((k.decode() for k in _KINDS if b" " + k + b" " in title), "backend")


Processes = dict[int, tuple[str, float]]  # a server process's kind and CPU seconds, by pid


@dataclass(frozen=True, slots=True)
class CpuSample:
    own: float
    broker: float  # the Kafka broker's (a ``kafka.Kafka`` process on this machine)
    server: Processes  # PostgreSQL's, process by process

    @property
    def postgres(self) -> float:
        return sum(seconds for _, seconds in self.server.values())

    @property
    def walsender(self) -> float:
        """The live WAL senders' share of :attr:`postgres`."""
        return sum(seconds for kind, seconds in self.server.values() if kind == "walsender")


class CpuMeter:
    """Samples CPU time of this process (with its children), of the PostgreSQL server ``conn`` is
    connected to, of its WAL senders, and of the Kafka broker (the one listening on the port of
    ``HARVESTER_TEST_KAFKA``; every ``kafka.Kafka`` process when that one is not found): on two
    shared cores, what one relay makes the server or the broker spend is taken from the others."""

    def __init__(self, conn: psycopg.Connection[Any], *, without_own: bool = False) -> None:
        """With ``without_own``, the server's figures leave out the backend of ``conn``: the
        benchmark's own session (its COPY, its probes), not a relay's work."""
        pid = backend_pid(conn)
        fields = proc_stat(pid)
        assert fields is not None, "PostgreSQL must run on this machine for its CPU to be measured"
        self._postmaster = int(fields[1])  # the backend's parent
        self._left_out = pid if without_own else None
        # The broker the benchmarks talk to, by its listening port: other Kafka brokers on the
        # machine (tests' private ones) come and go, and summing them made negative figures.
        self._broker = listener(bootstrap_port())

    def processes(self) -> Processes:
        """Each process of the server: its kind (:func:`postgres_kind`; ``exited`` for the
        postmaster, whose time includes its exited children's) and its CPU seconds so far."""
        server: Processes = {}
        for entry in Path("/proc").iterdir():
            if entry.name.isdigit() and (fields := proc_stat(int(entry.name))) is not None:
                pid = int(entry.name)
                if pid == self._postmaster:
                    server[pid] = ("exited", cpu_seconds(fields, children=True))
                elif int(fields[1]) == self._postmaster and pid != self._left_out:
                    server[pid] = (postgres_kind(_command(pid)), cpu_seconds(fields, children=False))
        return server

    def sample(self) -> CpuSample:
        return CpuSample(own_seconds(), self._broker_seconds(), self.processes())

    def _broker_seconds(self) -> float:
        if self._broker is not None:
            return process_seconds(self._broker)
        return sum(
            process_seconds(int(entry.name))
            for entry in Path("/proc").iterdir()
            if entry.name.isdigit() and b"\0kafka.Kafka\0" in _command(int(entry.name))
        )


def by_kind(before: Processes, after: Processes) -> dict[str, float]:
    """CPU seconds per kind of server process from ``before`` to ``after``: a process that exited
    in between is in ``exited`` with what it spent after ``before``."""
    kinds: defaultdict[str, float] = defaultdict(float)
    for pid, (kind, seconds) in after.items():
        kinds[kind] += seconds - before.get(pid, (kind, 0.0))[1]
    for pid, (_, seconds) in before.items():
        if pid not in after:  # its time so far is in the postmaster's now
            kinds["exited"] -= seconds
    return dict(kinds)


def kinds_per_thousand(before: CpuSample, after: CpuSample, records: int) -> dict[str, float]:
    """PostgreSQL's CPU seconds per 1,000 records from ``before`` to ``after`` by kind of server
    process (:func:`by_kind`): which process a costly round's PostgreSQL figure came from."""
    kinds = by_kind(before.server, after.server)
    scale = 1000 / max(1, records)
    rounded = {kind: round(seconds * scale, 5) for kind, seconds in sorted(kinds.items())}
    return {kind: figure for kind, figure in rounded.items() if figure}


def bootstrap_port() -> int:
    """The port of the first broker in HARVESTER_TEST_KAFKA (the benchmarks' bootstrap)."""
    first = os.environ.get("HARVESTER_TEST_KAFKA", "127.0.0.1:9092").split(",")[0]
    return int(first.rsplit(":", 1)[1])


def listener(port: int) -> int | None:
    """The process listening on TCP ``port`` on this machine (None if not found: not visible here)."""
    inodes = set()
    for table in ("/proc/net/tcp", "/proc/net/tcp6"):
        with contextlib.suppress(OSError):
            for line in Path(table).read_text().splitlines()[1:]:
                cols = line.split()
                if cols[3] == "0A" and int(cols[1].rsplit(":", 1)[1], 16) == port:  # 0A: LISTEN
                    inodes.add(f"socket:[{cols[9]}]")
    if not inodes:
        return None
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        with contextlib.suppress(OSError):
            for fd in (entry / "fd").iterdir():
                with contextlib.suppress(OSError):
                    if os.readlink(fd) in inodes:
                        return int(entry.name)
    return None


def per_thousand(before: CpuSample, after: CpuSample, records: int) -> tuple[float, float]:
    """CPU seconds per 1,000 records: (this process, PostgreSQL)."""
    scale = 1000 / max(1, records)
    return (after.own - before.own) * scale, (after.postgres - before.postgres) * scale


class CollectorTime:
    """CPU seconds this process spent in garbage collections, and how many ran, while installed
    (``with CollectorTime() as gc_time: ...``): what the harvester's CPU per record owes the collector."""

    def __init__(self) -> None:
        self.seconds = 0.0
        self.collections = 0
        self._started = 0.0

    def _callback(self, phase: str, _info: dict[str, int]) -> None:
        if phase == "start":
            self._started = time.thread_time()  # the collection runs on the thread that set it off
        else:
            self.seconds += time.thread_time() - self._started
            self.collections += 1

    def __enter__(self) -> CollectorTime:
        gc.callbacks.append(self._callback)
        return self

    def __exit__(self, *_exc: object) -> None:
        gc.callbacks.remove(self._callback)

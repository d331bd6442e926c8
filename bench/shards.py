"""Sharded harvesting: the aggregate drain of one pre-loaded outbox by N shards, with CPU per record.

    ./dev.sh bench shards [--records 1000000] [--keys 1000] [--runs 1x1,2x2,4x4,2x1,4x1,4x1w2]

Each run ``SxP`` creates a fresh outbox (and the index of S shards, as ``reaper migrate`` builds
it), starts P ``reaper run`` processes with ``shards: S`` and waits until the group coordinator has
spread the shards over them; then one transaction COPies the backlog in (a burst that becomes
visible at once, at its commit, like a Spark job's), and the drain is timed from that commit to the
empty table. It prints the aggregate rate, its ratio to ``1x1`` of the same run, which process led
which shards, and CPU seconds per 1,000 records of the reapers (together) and of PostgreSQL. A run
with fewer processes than shards (``2x1``, ``4x1``) shows what one process leading several shards
gets out of its threads: its CPU per wall second above 1.0 is work done outside the GIL. "Python
share" is the part of the reapers' CPU not spent on librdkafka's native threads: the threads that
run Python hold the GIL for it, apart from psycopg's and confluent-kafka's waits on I/O, so a process
running its shards as threads cannot use much more than 1 / that share of a core. A run ``SxPwW``
starts each of the P processes with ``--workers W``: a supervisor and W reaper processes, so that the
shards of one ``reaper run`` are led on W cores (the CPU counts the supervisor and its workers).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient
from cpu import CpuMeter, librdkafka_seconds, process_seconds
from psycopg import sql
from workload import BOOTSTRAP, DSN, copy_rows, fresh_topic

from harvester import TableName, migrate
from harvester.postgres.schema.migrations import ensure_shard_index

REAPER = str(Path(sys.executable).parent / "reaper")


@dataclass(frozen=True, slots=True)
class Run:
    shards: int
    processes: int
    workers: int
    rate: float  # records/s, first purge to empty
    cpu_reapers: float  # CPU seconds per 1,000 records, all reaper processes
    cpu_postgres: float
    cpu_broker: float
    reaper_cores: float  # the reapers' CPU seconds per wall second of the drain
    python_share: float  # of the reapers' CPU, the part not on librdkafka's native threads
    led: list[list[int]]  # the shards each process (each worker) led when the drain ended


class Reaper:
    """One ``reaper run`` process (with ``workers`` > 1, a supervisor whose workers share its output);
    follows the JSON log for the shards each instance leads."""

    def __init__(self, config: Path, workers: int) -> None:
        self.proc = subprocess.Popen(
            [REAPER, "run", "-f", str(config), "--workers", str(workers)],
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )
        self.workers = workers
        self.led: dict[str, set[int]] = {}  # by instance name
        self._reader = threading.Thread(target=self._read, daemon=True)
        self._reader.start()

    def _read(self) -> None:
        assert self.proc.stdout is not None
        for line in self.proc.stdout:
            try:
                event = json.loads(line)
            except json.JSONDecodeError:
                continue
            led = self.led.setdefault(str(event.get("instance")), set())
            if event.get("event") == "LeaderAcquired":
                led.add(int(event.get("shard", 0)))
            elif event.get("event") in ("LeaderRevoked", "LeaderFenced"):
                led.discard(int(event.get("shard", 0)))

    def pids(self) -> list[int]:
        """This process and its workers."""
        found, todo = [], [self.proc.pid]
        while todo:
            pid = todo.pop()
            found.append(pid)
            for task in Path(f"/proc/{pid}/task").glob("*/children"):
                todo += [int(c) for c in task.read_text().split()]
        return found

    def stop(self) -> None:
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait()


def config_file(directory: Path, table: TableName, shards: int, group: str) -> Path:
    path = directory / f"{group}.yaml"
    path.write_text(
        json.dumps(
            {
                "harvest": {
                    "dataSource": DSN,
                    "outboxTable": table.qualified,
                    "leaderGroupID": group,
                    "baseKafkaConfig": {"bootstrap.servers": BOOTSTRAP},
                    "shards": shards,
                },
                "logging": {"format": "json"},
                "http": {"enabled": False},
            }
        ),
        "utf-8",
    )
    return path


def spread(reapers: list[Reaper], shards: int) -> bool:
    """Every shard has a leader and every process (worker) leads some (or as many as there are shards)."""
    sets = [set(led) for r in reapers for led in list(r.led.values())]
    busy = min(sum(r.workers for r in reapers), shards)
    return sorted(s for led in sets for s in led) == list(range(shards)) and sum(1 for led in sets if led) == busy


def drain(conn: psycopg.Connection[Any], shards: int, processes: int, workers: int, records: int, keys: int) -> Run:
    # Not "bench_": bench/workload.py drops every such schema when it cleans up, other runs' too.
    table = TableName(f"shardbench_{uuid.uuid4().hex[:8]}", "outbox")
    migrate(conn, table)
    topic = fresh_topic()
    ensure_shard_index(conn, table, shards)
    probe = sql.SQL("SELECT 1 FROM {} LIMIT 1").format(table.ident)
    meter = CpuMeter(conn)
    group = f"bench_{uuid.uuid4().hex[:8]}"
    with tempfile.TemporaryDirectory() as tmp:
        config = config_file(Path(tmp), table, shards, group)
        reapers = [Reaper(config, workers) for _ in range(processes)]
        try:
            deadline = time.monotonic() + 120
            while not spread(reapers, shards):
                if time.monotonic() > deadline:
                    raise RuntimeError(f"shards not spread over the reapers: {[r.led for r in reapers]}")
                time.sleep(0.1)
            time.sleep(1.0)  # let the last term starts (fence, first idle mark) settle
            conn.execute("CHECKPOINT")
            # One transaction: the whole backlog becomes visible at once, at its commit.
            copy_rows(conn, table, topic, records, keys)
            pids = [pid for r in reapers for pid in r.pids()]
            before, own_before, started = meter.sample(), sum(map(process_seconds, pids)), time.perf_counter()
            native_before = sum(map(librdkafka_seconds, pids))
            while conn.execute(probe).fetchone() is not None:
                time.sleep(0.02)
            elapsed = time.perf_counter() - started
            after, own_after = meter.sample(), sum(map(process_seconds, pids))
            native = sum(map(librdkafka_seconds, pids)) - native_before
            led = [sorted(led) for r in reapers for led in r.led.values() if led]
        finally:
            for r in reapers:
                r.stop()
    conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(str(table.schema))))
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
    for future in admin.delete_topics([topic, f"{group}.neli"]).values():
        future.result(30)
    scale = 1000 / records
    return Run(
        shards,
        processes,
        workers,
        records / elapsed,
        (own_after - own_before) * scale,
        (after.postgres - before.postgres) * scale,
        (after.broker - before.broker) * scale,
        (own_after - own_before) / elapsed,
        1 - native / max(own_after - own_before, 1e-9),
        led,
    )


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=1_000_000, help="backlog COPied in one transaction per run")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--runs", default="1x1,2x2,4x4,2x1,4x1,4x1w2", help="comma-separated SHARDSxPROCESSES[wWORKERS]")
    args = p.parse_args()
    runs = [_run(r) for r in args.runs.split(",")]
    print(f"workload: bursts of {args.records} records, {args.keys} keys, default limits; {os.cpu_count()} cores")
    print(
        "run     records/s  vs 1x1  reapers CPU s/1k  PostgreSQL CPU s/1k  reaper cores  Python share"
        "  shards led per process"
    )
    base: float | None = None
    with psycopg.connect(DSN, autocommit=True) as conn:
        for shards, processes, workers in runs:
            r = drain(conn, shards, processes, workers, args.records, args.keys)
            base = r.rate if base is None and (shards, processes, workers) == (1, 1, 1) else base
            ratio = f"{r.rate / base:5.2f}x" if base else "   - "
            name = f"{shards}x{processes}" + (f"w{workers}" if workers > 1 else "")
            print(
                f"{name:6}  {r.rate:10.0f}  {ratio}  {r.cpu_reapers:17.3f}  {r.cpu_postgres:19.3f}"
                f"  {r.reaper_cores:12.2f}  {r.python_share:12.0%}  {r.led}",
                flush=True,
            )


def _run(text: str) -> tuple[int, int, int]:
    """``SxP`` or ``SxPwW``: shards, processes and workers per process."""
    shards, rest = text.split("x")
    processes, _, workers = rest.partition("w")
    return int(shards), int(processes), int(workers or 1)


if __name__ == "__main__":
    main()

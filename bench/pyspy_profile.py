"""Where the harvester's own CPU goes in a burst: py-spy samples the relay (the harvester in a
process of its own, with the log source's producer process) while a burst is COPied into its idle
outbox and drained, then the top entries by self and by cumulative samples are printed.

    python bench/pyspy_profile.py [--source log] [--records 200000] [--keys 1000] [--rate 100] [--top 25]
        [--all-threads] [--drain-only] [--out /tmp/profile-log.txt]

``--source`` is ``log`` (the log source, default limits) or ``mark_purge`` (the polling source).
Needs py-spy (in the dev extra) and the local services
(``HARVESTER_TEST_PG_DSN``, with ``wal_level=logical`` for the log source; ``HARVESTER_TEST_KAFKA``).
The relay runs as bench/peers.py runs it in-process (``peer_relays.harvester_relay``); this process
writes the burst and waits for it, so the profile holds the relay alone from just before the COPY
to all records on the topic (and, polling, the outbox emptied); with ``--drain-only``, from the
burst's commit on, the drain alone (py-spy attaches within about half a second; the relay's CPU is
counted from the commit too). Samples are taken with
``--function`` (a frame is its function, not its line) and ``--gil`` (only the thread holding the
GIL: a share of the samples is a share of the Python interpreter's time, what the relay's threads
contend for; native code that releases the GIL, librdkafka's own threads and waits on PostgreSQL
are not in it: bench/peers.py's CPU meters count those). ``--all-threads`` samples every thread not
idle instead; on a loaded machine py-spy's idle test also counts threads waiting for a core, and
blocking reads showed as busy here, so waits are in those figures. The producer process's stacks
are among the relay's (py-spy labels them with the relay's process). Sampling pauses the relay:
read shares, not rates. The raw collapsed stacks go to ``--out`` (flamegraph.pl reads them).

It also prints PostgreSQL's CPU per 1,000 records by kind of server process (``walsender``,
``backend``: the sessions, the harvester's deletes among them, ``checkpointer``, ``autovacuum``, …;
``exited``: processes that ended meanwhile) from the start of the COPY to the outbox emptied, the
benchmark's own session (its COPY, its probes) left out, as bench/peers.py counts PostgreSQL's
(py-spy's pauses slow the relay, not the server's work per record).
"""

from __future__ import annotations

import argparse
import json
import re
import shutil
import signal
import subprocess
import sys
import time
from collections import Counter
from pathlib import Path

import psycopg
import workload
from confluent_kafka import Consumer
from cpu import CpuMeter, by_kind, librdkafka_seconds, proc_stat, process_seconds
from peer_bursts import LOG, MARK_PURGE, copy_burst, wait_published
from peer_relays import harvester_relay
from peer_services import BOOTSTRAP

from harvester import Limits, TableName

# A frame of py-spy's raw output: "function (file:line)"; the line is the function's first with --function.
_FRAME = re.compile(r"^(?P<function>.*) \((?P<file>[^():]*)(?::\d+)?\)$")


def relay(source: str) -> None:
    """The relay's process: the harvester over a fresh outbox until this process's stdin closes."""
    with psycopg.connect(workload.DSN, autocommit=True) as conn, harvester_relay(conn, Limits(), source) as r:
        where = {"schema": r.table.schema, "name": r.table.name, "topic": r.topic}
        print("relay " + json.dumps(where), flush=True)  # among the harvester's log lines
        sys.stdin.read()


def relay_cpu(pid: int) -> tuple[float, float]:
    """CPU seconds so far of the relay ``pid`` and its live children (the producer process): all of
    it, and its librdkafka threads' part (native, never in a --gil profile)."""
    pids = [pid] + [
        int(e.name)
        for e in Path("/proc").iterdir()
        if e.name.isdigit() and (fields := proc_stat(int(e.name))) is not None and int(fields[1]) == pid
    ]
    return sum(process_seconds(p) for p in pids), sum(librdkafka_seconds(p) for p in pids)


def _short(frame: str) -> str:
    m = _FRAME.match(frame)
    if not m:
        return frame
    path = m["file"]
    for marker in ("/harvester/", "/site-packages/", "/lib/python3"):
        if marker in path:
            path = path[path.index(marker) + 1 :]
            break
    return f"{m['function']} ({path})"


def tally(raw: Path) -> tuple[Counter[str], Counter[str], int]:
    """Self and cumulative samples per frame in py-spy's raw output, and the total."""
    own: Counter[str] = Counter()
    cumulative: Counter[str] = Counter()
    total = 0
    for line in raw.read_text().splitlines():
        stack, _, count = line.rpartition(" ")
        if not stack or not count.isdigit():
            continue
        frames = [_short(f) for f in stack.split(";") if not f.startswith(("process ", "thread "))]
        if not frames:
            continue
        n = int(count)
        total += n
        own[frames[-1]] += n
        for f in set(frames):
            cumulative[f] += n
    return own, cumulative, total


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--source", choices=(LOG, MARK_PURGE), default=LOG)
    p.add_argument("--records", type=int, default=200_000)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--rate", type=int, default=100, help="py-spy's samples per second")
    p.add_argument("--top", type=int, default=25)
    p.add_argument(
        "--all-threads",
        action="store_true",
        help="sample every thread on CPU or runnable, not only the one holding the GIL (waits then show)",
    )
    p.add_argument(
        "--drain-only",
        action="store_true",
        help="sample from the burst's commit on (the log source decodes a streamed burst while it is written)",
    )
    p.add_argument("--out", type=Path, help="py-spy's raw stacks (default /tmp/profile-SOURCE.txt)")
    p.add_argument("--relay", action="store_true", help=argparse.SUPPRESS)  # the profiled child
    args = p.parse_args()
    if args.relay:
        relay(args.source)
        return
    spy = shutil.which("py-spy")
    if spy is None:
        sys.exit("profile: py-spy is not installed here (pip install py-spy)")
    out = args.out or Path(f"/tmp/profile-{args.source}.txt")
    child = subprocess.Popen(
        [sys.executable, __file__, "--relay", "--source", args.source],
        stdin=subprocess.PIPE,
        stdout=subprocess.PIPE,
        text=True,
    )
    assert child.stdin is not None and child.stdout is not None
    try:
        while not (line := child.stdout.readline()).startswith("relay "):
            if not line:
                sys.exit("profile: the relay exited before it was ready")
        where = json.loads(line.removeprefix("relay "))
        table, topic = TableName(where["schema"], where["name"]), where["topic"]
        record = ["record", "--pid", str(child.pid), "--subprocesses", "--function", "--rate", str(args.rate)]
        if not args.all_threads:
            record.append("--gil")

        def sample() -> tuple[subprocess.Popen[str], tuple[float, float]]:
            """py-spy started on the relay, and the relay's CPU so far once it is attached."""
            sampler = subprocess.Popen(
                [spy, *record, "--format", "raw", "--output", str(out)],
                stdout=subprocess.DEVNULL,
                stderr=subprocess.PIPE,
                text=True,
            )
            time.sleep(0.5 if args.drain_only else 2.0)  # py-spy attached to the relay and its producer process
            return sampler, relay_cpu(child.pid)

        consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": "profile_count", "enable.auto.commit": False})
        with psycopg.connect(workload.DSN, autocommit=True) as conn:
            started = None if args.drain_only else sample()
            meter = CpuMeter(conn, without_own=True)  # the COPY and the probes are not the relay's
            server_before = meter.processes()
            committed = copy_burst(conn, table, topic, args.records, args.keys)
            sampler, cpu_before = started or sample()
            published = wait_published(consumer, topic, args.records)
            if args.source == MARK_PURGE:
                workload.wait_empty(conn, table)
            done = time.time()
            cpu_after = relay_cpu(child.pid)
            workload.wait_empty(conn, table)  # PostgreSQL's figure to the last delete, the log source's too
            server = by_kind(server_before, meter.processes())
        consumer.close()
        sampler.send_signal(signal.SIGINT)  # py-spy writes its output on SIGINT
        _, errors = sampler.communicate(timeout=60)
    finally:
        child.stdin.close()
        child.wait(60)
    if not out.exists():
        sys.exit(f"profile: py-spy wrote nothing: {errors.strip()[-300:]}")
    print(
        f"{args.source}: {args.records} records, {args.records / (published - committed):.0f} records/s to the topic"
        f" ({args.records / (done - committed):.0f} to done) under py-spy --rate {args.rate}; raw stacks in {out}"
    )
    cpu, native = (1e6 * (a - b) / args.records for a, b in zip(cpu_after, cpu_before, strict=True))
    print(
        f"relay CPU (both processes, py-spy's pauses included): {cpu:.1f} us per record, of which librdkafka's"
        f" threads {native:.1f} us ({100 * native / cpu:.0f}%); the rest is what the samples below share"
    )
    kinds = sorted(server.items(), key=lambda kv: -kv[1])
    print(
        "PostgreSQL CPU s per 1,000 records, from the COPY to the outbox emptied (the benchmark's own"
        " session left out): "
        + ", ".join(f"{kind} {1000 * seconds / args.records:.5f}" for kind, seconds in kinds)
        + f"; total {1000 * sum(server.values()) / args.records:.5f}"
    )
    own, cumulative, total = tally(out)
    for title, counts in (("self", own), ("cumulative", cumulative)):
        print(f"top {args.top} by {title} samples (of {total}):")
        for frame, n in counts.most_common(args.top):
            print(f"  {100 * n / total:5.1f}%  {frame}")


if __name__ == "__main__":
    main()

"""Large transactions written at once, drained by the log source under a ``logTransactionMemory``
budget: what the harvester holds at its peak, and what spilling the rest costs in speed.

    ./dev.sh bench log_memory [--records 900000] [--writers 3] [--memory 256MiB] [--rounds 2] [--keys 1000]

Each run, ``--writers`` connections COPY ``--records`` records between them (100-byte values), each
in one transaction, and commit together, into a fresh outbox that the log source reads (its own
publication and slot, in-process, default limits, lz4). The baseline runs under the default budget
(1GiB: unless the records outgrow it, nothing spills), the other under ``--memory``; each run is a
process of its own, so that its peak resident memory (VmHWM) is its own, and the two alternate.
Printed per budget: records/s from the commit until all are on the topic (medians), the harvester's
CPU seconds per 1,000 records, and the peak resident memory, next to the budget (the rest of the
process, Python, librdkafka and the engine, comes on top of it: about 100 MB). The budget is an
estimate of what the records take (docs/log-source.md, "Memory"), not of the process.
"""

from __future__ import annotations

import argparse
import json
import statistics
import subprocess
import sys
import threading
import time
from typing import Any

import peer_relays
import psycopg
import workload
from confluent_kafka import Consumer
from cpu import own_seconds
from peer_bursts import LOG, wait_published
from pydantic import ValidationError

from harvester import HarvesterConfig, Limits, TableName

DEFAULT = int(HarvesterConfig().log_transaction_memory)
_PART = 20_000  # rows per COPY of a writer


def write_at_once(table: TableName, topic: str, records: int, writers: int, keys: int) -> float:
    """COPY ``records`` rows in ``writers`` transactions, one per connection and thread, committing
    together once all have written; when the last committed (wall time)."""
    ready = threading.Barrier(writers)
    errors: list[BaseException] = []

    def write(n: int) -> None:
        try:
            rows = range(n * records // writers, (n + 1) * records // writers)
            with psycopg.connect(workload.DSN) as conn, conn.transaction():
                for at in range(rows.start, rows.stop, _PART):
                    workload.copy_part(conn, table, topic, range(at, min(at + _PART, rows.stop)), keys)
                ready.wait()
        except BaseException as exc:  # reported by the caller
            ready.abort()
            errors.append(exc)

    threads = [threading.Thread(target=write, args=(n,)) for n in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    if errors:
        raise errors[0]
    return time.time()


def peak_rss() -> int:
    """This process's peak resident memory, bytes."""
    with open("/proc/self/status") as status:
        line = next(line for line in status if line.startswith("VmHWM:"))
    return int(line.split()[1]) * 1024


def run_one(records: int, writers: int, keys: int, memory: int) -> dict[str, float]:
    """One drain under ``memory``, in this process."""
    workload.PRODUCER = {"compression.type": "lz4"}
    consumer = Consumer(
        {"bootstrap.servers": workload.BOOTSTRAP, "group.id": "log_memory", "enable.auto.commit": False}
    )
    try:
        with (
            psycopg.connect(workload.DSN, autocommit=True) as conn,
            peer_relays.harvester_relay(conn, Limits(), LOG, memory) as relay,
        ):
            committed = write_at_once(relay.table, relay.topic, records, writers, keys)
            own = own_seconds()
            published = wait_published(consumer, relay.topic, records)
            cpu = own_seconds() - own
    finally:
        consumer.close()
    return {"rate": records / (published - committed), "cpu": cpu * 1000 / records, "peak": peak_rss()}


def size(text: str) -> int:
    """``text`` read as the reaper reads logTransactionMemory."""
    try:
        return int(HarvesterConfig.model_validate({"logTransactionMemory": text}).log_transaction_memory)
    except ValidationError as exc:
        raise argparse.ArgumentTypeError(exc.errors()[0]["msg"]) from None


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=900_000, help="records written, across the writers")
    p.add_argument("--writers", type=int, default=3, help="transactions written at once, one per connection")
    p.add_argument("--memory", type=size, default=size("256MiB"), help="the budget measured (default 256MiB)")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--one", type=int, help=argparse.SUPPRESS)  # a child: one run under this budget
    args = p.parse_args()
    if args.writers < 1 or args.records < args.writers:
        sys.exit("log_memory: --writers must be at least 1 and at most --records")
    if args.one is not None:
        print(json.dumps(run_one(args.records, args.writers, args.keys, args.one)))
        return
    budgets = {"default 1GiB (baseline)": DEFAULT, f"--memory {args.memory / 2**20:g}MiB": args.memory}
    print(
        f"workload: {args.records} records in {args.writers} transactions written at once, {args.keys} keys,"
        f" {len(workload.VALUE)}-byte values; log source in-process, default limits, lz4; {args.rounds} rounds",
        flush=True,
    )
    results: dict[str, list[dict[str, Any]]] = {name: [] for name in budgets}
    for r in range(args.rounds):
        for name, memory in list(budgets.items())[:: 1 if r % 2 == 0 else -1]:
            child = [sys.executable, __file__, "--records", str(args.records), "--writers", str(args.writers)]
            child += ["--keys", str(args.keys), "--one", str(memory)]
            out = subprocess.run(child, check=False, capture_output=True, text=True)
            if out.returncode != 0:
                sys.exit(f"log_memory: the run under {name} failed (exit {out.returncode}):\n{out.stderr}")
            result = json.loads(out.stdout.strip().splitlines()[-1])
            results[name].append(result)
            peak = result["peak"] / 2**20
            print(f"  round {r + 1}: {name:<26} {result['rate']:9.0f} records/s, peak {peak:5.0f} MiB", flush=True)
    base = statistics.median(x["rate"] for x in results[next(iter(budgets))])
    print(f"\n{'budget':<26} {'records/s':>10} {'vs baseline':>12} {'CPU s/1000':>11} {'peak MiB':>9}")
    for name, runs in results.items():
        rate = statistics.median(x["rate"] for x in runs)
        cpu = statistics.median(x["cpu"] for x in runs)
        peak = max(x["peak"] for x in runs) / 2**20
        print(f"{name:<26} {rate:10.0f} {rate / base:11.2f}x {cpu:11.4f} {peak:9.0f}")


if __name__ == "__main__":
    main()

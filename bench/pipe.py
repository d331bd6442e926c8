"""The producer process's path alone: a :class:`~harvester.kafka.process_publisher.ProcessPublisher`
fed stamped records in batches, as the at-least-once dispatcher publishes them, with a window of
records in flight, into the local Kafka; prints the rate and the CPU per record of the harvester's
side (this process: publishing, pickling the batches, reading the reports), of the producer
process's Python threads and of its librdkafka threads.

    python bench/pipe.py [--records 400000] [--batch 500] [--window 5000] [--rounds 3]

Needs the local Kafka (bench/workload.py's). To compare two checkouts,
run it from each in turn with that checkout first on ``PYTHONPATH``, alternating: the producer process
imports the package the publisher's module belongs to."""

from __future__ import annotations

import argparse
import inspect
import os
import queue
import time
from collections.abc import Callable
from datetime import UTC, datetime

from workload import BOOTSTRAP, fresh_topic

from harvester.core.identity import IdentityHeaders, Stamp
from harvester.core.protocols import DeliveryReport
from harvester.core.records import MarkedRecord
from harvester.kafka.process_publisher import ProcessPublisher
from harvester.runtime import tune_garbage_collector

_TICK = os.sysconf("SC_CLK_TCK")


def threads_cpu(pid: int) -> dict[str, float]:
    """CPU seconds of ``pid``'s threads so far, summed by thread name (``python``: the interpreter's)."""
    out: dict[str, float] = {}
    for tid in os.listdir(f"/proc/{pid}/task"):
        try:
            with open(f"/proc/{pid}/task/{tid}/comm") as f:
                name = f.read().strip()
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:
            continue
        kind = "librdkafka" if name.startswith("rdk:") else "python"
        out[kind] = out.get(kind, 0.0) + (int(fields[11]) + int(fields[12])) / _TICK
    return out


def round_(records: int, batch: int, window: int) -> dict[str, float]:
    topic = fresh_topic()
    stamp = Stamp.of(IdentityHeaders(), 7, b"7312345678901234567/public.outbox")
    now = datetime.now(UTC)
    out = [MarkedRecord(i, now, topic, f"key-{i % 1000}", os.urandom(100), [], stamp=stamp) for i in range(records)]
    reports: queue.SimpleQueue[DeliveryReport] = queue.SimpleQueue()  # as the dispatcher takes them
    config = {"bootstrap.servers": BOOTSTRAP, "compression.type": "lz4", "linger.ms": 5, "enable.idempotence": True}
    publisher = ProcessPublisher(config, reports.put_nowait, in_order=True)
    child = publisher.child_pid
    publish: Callable[[list[MarkedRecord]], None] = publisher.publish
    if "records" not in inspect.signature(publish).parameters:  # a checkout from before 437c7bb

        def one_by_one(records: list[MarkedRecord]) -> None:
            for record in records:
                publisher.publish(record)  # type: ignore[arg-type]

        publish = one_by_one
    answered = 0
    before, own, start = threads_cpu(child), time.process_time(), time.monotonic()
    for at in range(0, records, batch):
        while at - answered >= window:
            reports.get()
            answered += 1
        publish(out[at : at + batch])
    while answered < records:
        reports.get()
        answered += 1
    seconds, own = time.monotonic() - start, time.process_time() - own
    after = threads_cpu(child)
    publisher.close(10)
    micros = 1e6 / records
    return {
        "rate": records / seconds,
        "harvester": own * micros,
        "child_python": (after.get("python", 0.0) - before.get("python", 0.0)) * micros,
        "child_librdkafka": (after.get("librdkafka", 0.0) - before.get("librdkafka", 0.0)) * micros,
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=400_000)
    p.add_argument("--batch", type=int, default=500)
    p.add_argument("--window", type=int, default=5000)
    p.add_argument("--rounds", type=int, default=3)
    args = p.parse_args()
    tune_garbage_collector()  # as the reaper does
    print(f"{args.records} records, batches of {args.batch}, {args.window} in flight; µs of CPU per record:")
    for n in range(args.rounds):
        r = round_(args.records, args.batch, args.window)
        total = r["harvester"] + r["child_python"] + r["child_librdkafka"]
        print(
            f"  round {n + 1}: {r['rate']:8.0f} records/s  harvester {r['harvester']:5.2f}  producer process:"
            f" Python {r['child_python']:5.2f}, librdkafka {r['child_librdkafka']:5.2f}  total {total:5.2f}"
        )


if __name__ == "__main__":
    main()

"""At-least-once vs exactly-once, side by side in one run.

    ./dev.sh bench delivery_modes [--records 50000] [--rate 1000] [--seconds 10]

For each mode: drain rate of a pre-loaded outbox with 1,000 keys (uniform) and with 10 keys (hot
keys), and commit-to-acknowledgement latency at a fixed insert rate. Exactly-once is measured
as a read_committed consumer would see it: a batch counts when its transaction committed.
"""

from __future__ import annotations

import argparse
import time
import uuid
from typing import Any

import psycopg
import workload

from harvester import Engine, Limits, PostgresStore, TableName
from harvester.core.at_least_once import at_least_once
from harvester.core.dispatch import DispatcherFactory
from harvester.core.exactly_once import exactly_once
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import DeliveryCallback, DeliveryReport
from harvester.kafka.publisher import KafkaPublisher, producer_config
from harvester.kafka.topics import ensure_topic
from harvester.kafka.transactions import KafkaTransactionalPublisher
from harvester.runtime import tune_garbage_collector
from leader.events import LeaderAcquired


class TimedTransactions(KafkaTransactionalPublisher):
    """Records the commit time of every record's transaction."""

    def __init__(self, acked: dict[int, float], *args: Any) -> None:
        super().__init__(*args)
        self._acked = acked

    def publish_batch(self, records: Any, epoch: int) -> int:
        position = super().publish_batch(records, epoch)
        now = time.time()
        for r in records:
            self._acked[r.id] = now
        return position


def start(table: TableName, limits: Limits, mode: str, acked: dict[int, float]) -> tuple[Engine, PostgresStore]:
    store = PostgresStore.open(workload.DSN, table)
    config = producer_config({"bootstrap.servers": workload.BOOTSTRAP}, {})
    dispatcher: DispatcherFactory

    def factory(cb: DeliveryCallback) -> KafkaPublisher:
        def timed(report: DeliveryReport) -> None:
            if report[1] is None:
                acked[report[0].id] = time.time()
            cb(report)

        return KafkaPublisher(config, timed)

    if mode == "exactly_once":
        group = f"bench_{uuid.uuid4().hex[:8]}"
        ensure_topic(config, f"{group}.checkpoints")
        transactions = TimedTransactions(acked, config, f"{group}.harvester", f"{group}.checkpoints")
        dispatcher = exactly_once(store, transactions)
    else:
        dispatcher = at_least_once(store, factory)
    tune_garbage_collector()  # as the reaper sets it
    engine = Engine(store, dispatcher, limits, HarvesterMetrics(), lambda e: None)
    engine.start()
    engine.on_leader_event(LeaderAcquired(uuid.uuid4()))
    return engine, store


def drain(conn: psycopg.Connection[Any], records: int, keys: int, limits: Limits, mode: str) -> float:
    table, topic = workload.fresh_outbox(conn), workload.fresh_topic()
    workload.preload(conn, table, topic, records, keys)
    started = time.perf_counter()
    engine, store = start(table, limits, mode, {})
    workload.wait_empty(conn, table)
    elapsed = time.perf_counter() - started
    workload.stop(engine, store)
    return records / elapsed


def latency(conn: psycopg.Connection[Any], rate: float, seconds: float, limits: Limits, mode: str) -> list[float]:
    table, topic = workload.fresh_outbox(conn), workload.fresh_topic()
    acked: dict[int, float] = {}
    engine, store = start(table, limits, mode, acked)
    time.sleep(1.0)
    commits: dict[int, float] = {}
    workload.writer_loop(table, topic, 1000, time.monotonic() + seconds, rate, commits)
    workload.wait_empty(conn, table)
    workload.stop(engine, store)
    return sorted((acked[i] - c) * 1000 for i, c in commits.items() if i in acked)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=50_000)
    p.add_argument("--rate", type=float, default=1000.0)
    p.add_argument("--seconds", type=float, default=10.0)
    p.add_argument("--mark-query-records", type=int, default=500)
    p.add_argument("--max-in-flight", type=int, default=5000)
    args = p.parse_args()
    limits = Limits(mark_query_records=args.mark_query_records, max_in_flight_records=args.max_in_flight)
    print(
        f"{args.records} records of ~100 bytes; mark_query_records={limits.mark_query_records}, "
        f"max_in_flight_records={limits.max_in_flight_records}"
    )
    print(f"{'mode':<15}{'uniform (1000 keys)':>22}{'hot keys (10 keys)':>22}{'p50 @rate':>12}{'p99 @rate':>12}")
    results: dict[str, tuple[float, float]] = {}
    with psycopg.connect(workload.DSN, autocommit=True) as conn:
        try:
            for mode in ("at_least_once", "exactly_once"):
                uniform = drain(conn, args.records, 1000, limits, mode)
                hot = drain(conn, args.records, 10, limits, mode)
                lat = latency(conn, args.rate, args.seconds, limits, mode)
                results[mode] = (uniform, hot)
                print(
                    f"{mode:<15}{uniform:>16.0f} rec/s{hot:>16.0f} rec/s"
                    f"{workload.pct(lat, 0.5):>9.1f} ms{workload.pct(lat, 0.99):>9.1f} ms"
                )
        finally:
            workload.cleanup(conn)
    alo, eos = results["at_least_once"], results["exactly_once"]
    print(f"exactly-once / at-least-once: uniform {eos[0] / alo[0]:.0%}, hot keys {eos[1] / alo[1]:.0%}")


if __name__ == "__main__":
    main()

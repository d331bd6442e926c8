"""Engine throughput and latency, next to the two ceilings measured in the same run.

    ./dev.sh bench harvest [--records 100000] [--keys 1000] [--rate 1000] [--seconds 15]

Prints:
  1. ceiling: confluent-kafka alone producing the same records (same producer settings);
  2. ceiling: the mark + purge SQL alone on the same pre-loaded outbox;
  3. harvester draining a pre-loaded outbox (records/s), and as a share of the lower ceiling;
  4. harvester under steady concurrent inserts (records/s harvested while writers insert);
  5. latency from insert commit to delivery ack at a fixed insert rate (p50/p99/max);
  6. queries per second of an idle harvester.
"""

from __future__ import annotations

import argparse
import os
import statistics
import threading
import time
import uuid
from typing import Any

import psycopg
from confluent_kafka import Producer
from confluent_kafka.admin import AdminClient, NewTopic
from psycopg import sql

from harvester import Engine, Limits, PostgresStore, TableName, migrate
from harvester.core.at_least_once import at_least_once
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import DeliveryCallback
from harvester.core.records import MarkedRecord
from harvester.kafka.publisher import KafkaPublisher, producer_config
from leader.events import LeaderAcquired

DSN = os.environ.get(
    "HARVESTER_TEST_PG_DSN", "host=127.0.0.1 port=5432 user=harvester password=local-dev-secret dbname=harvester"
)
BOOTSTRAP = os.environ.get("HARVESTER_TEST_KAFKA", "127.0.0.1:9092")
VALUE = "x" * 100


def fresh_outbox(conn: psycopg.Connection[Any]) -> TableName:
    table = TableName(f"bench_{uuid.uuid4().hex[:8]}", "outbox")
    migrate(conn, table)
    return table


def fresh_topic(partitions: int = 4) -> str:
    name = f"bench_{uuid.uuid4().hex[:8]}"
    admin = AdminClient({"bootstrap.servers": BOOTSTRAP})  # must outlive the futures
    for f in admin.create_topics([NewTopic(name, partitions, 1)]).values():
        f.result(30)
    return name


def preload(conn: psycopg.Connection[Any], table: TableName, topic: str, records: int, keys: int) -> None:
    copy = sql.SQL("COPY {} (create_time, kafka_topic, kafka_key, kafka_value) FROM STDIN").format(table.ident)
    with conn.transaction(), conn.cursor().copy(copy) as cp:
        now = time.time()
        for i in range(records):
            cp.write_row((time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime(now)), topic, f"key{i % keys}", VALUE))
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table.ident))


def count(conn: psycopg.Connection[Any], table: TableName) -> int:
    row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone()
    return int(row[0]) if row else 0


def ceiling_producer(records: int, keys: int) -> float:
    topic = fresh_topic()
    producer = Producer(producer_config({"bootstrap.servers": BOOTSTRAP}, {}))
    acked = 0

    def on_delivery(err: Any, _msg: Any) -> None:
        nonlocal acked
        acked += err is None

    value = VALUE.encode()
    started = time.perf_counter()
    for i in range(records):
        while True:
            try:
                producer.produce(topic, value=value, key=f"key{i % keys}".encode(), on_delivery=on_delivery)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    producer.flush(60)
    elapsed = time.perf_counter() - started
    assert acked == records, f"producer ceiling: {acked} of {records} acknowledged"
    return records / elapsed


def ceiling_sql(conn: psycopg.Connection[Any], records: int, keys: int, batch: int) -> float:
    table = fresh_outbox(conn)
    preload(conn, table, "t", records, keys)
    store = PostgresStore.open(DSN, table)
    leader = uuid.uuid4()
    store.acquire(leader)
    started = time.perf_counter()
    done = 0
    while True:
        marked = store.mark(leader, batch)
        if not marked:
            break
        store.purge([r.id for r in marked])
        done += len(marked)
    elapsed = time.perf_counter() - started
    store.close()
    assert done == records
    return records / elapsed


class TimedPublisher(KafkaPublisher):
    """Records each record's acknowledgement time, for end-to-end latency."""

    def __init__(self, config: dict[str, Any], callback: DeliveryCallback, acked: dict[int, float]) -> None:
        def timed(record: MarkedRecord, error: Exception | None) -> None:
            if error is None:
                acked[record.id] = time.time()
            callback(record, error)

        super().__init__(config, timed)


def run_engine(table: TableName, limits: Limits, acked: dict[int, float] | None = None) -> tuple[Engine, PostgresStore]:
    store = PostgresStore.open(DSN, table)
    config = producer_config({"bootstrap.servers": BOOTSTRAP}, {})
    sink: dict[int, float] = acked if acked is not None else {}

    def factory(cb: DeliveryCallback) -> KafkaPublisher:
        return TimedPublisher(config, cb, sink)

    engine = Engine(store, at_least_once(store, factory), limits, HarvesterMetrics(), lambda e: None)
    engine.start()
    engine.on_leader_event(LeaderAcquired(uuid.uuid4()))
    return engine, store


def stop(engine: Engine, store: PostgresStore) -> None:
    engine.stop_marking()
    engine.drain(30)
    engine.close(10)
    store.close()


def wait_empty(conn: psycopg.Connection[Any], table: TableName, timeout: float = 600) -> None:
    deadline = time.monotonic() + timeout
    while count(conn, table) and time.monotonic() < deadline:
        time.sleep(0.02)


def drain_preloaded(conn: psycopg.Connection[Any], records: int, keys: int, limits: Limits) -> float:
    table, topic = fresh_outbox(conn), fresh_topic()
    preload(conn, table, topic, records, keys)
    started = time.perf_counter()
    engine, store = run_engine(table, limits)
    wait_empty(conn, table)
    elapsed = time.perf_counter() - started
    stop(engine, store)
    return records / elapsed


def writer_loop(
    table: TableName, topic: str, keys: int, until: float, rate: float | None, commits: dict[int, float]
) -> None:
    """Insert 10-record transactions, as fast as possible or at ``rate`` records/s."""
    insert = sql.SQL(
        "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value) "
        "SELECT now(), %s, 'key' || ((%s + g) %% %s), %s FROM generate_series(1, 10) g RETURNING id"
    ).format(table.ident)
    n = 0
    with psycopg.connect(DSN, autocommit=True) as conn:
        next_at = time.monotonic()
        while time.monotonic() < until:
            ids = [r[0] for r in conn.execute(insert, (topic, n, keys, VALUE)).fetchall()]
            committed = time.time()
            for i in ids:
                commits[i] = committed
            n += 10
            if rate:
                next_at += 10 / rate
                time.sleep(max(0.0, next_at - time.monotonic()))


def steady(
    conn: psycopg.Connection[Any], keys: int, seconds: float, limits: Limits, writers: int = 2
) -> tuple[float, float]:
    table, topic = fresh_outbox(conn), fresh_topic()
    acked: dict[int, float] = {}
    engine, store = run_engine(table, limits, acked)
    commits: dict[int, float] = {}
    until = time.monotonic() + seconds
    threads = [
        threading.Thread(target=writer_loop, args=(table, topic, keys, until, None, commits)) for _ in range(writers)
    ]
    started = time.perf_counter()
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    inserted = len(commits)
    harvested_during = len(acked)
    elapsed = time.perf_counter() - started
    wait_empty(conn, table)
    stop(engine, store)
    return inserted / elapsed, harvested_during / elapsed


def latency(conn: psycopg.Connection[Any], keys: int, rate: float, seconds: float, limits: Limits) -> list[float]:
    table, topic = fresh_outbox(conn), fresh_topic()
    acked: dict[int, float] = {}
    engine, store = run_engine(table, limits, acked)
    time.sleep(1.0)
    commits: dict[int, float] = {}
    writer_loop(table, topic, keys, time.monotonic() + seconds, rate, commits)
    wait_empty(conn, table)
    stop(engine, store)
    return sorted((acked[i] - c) * 1000 for i, c in commits.items() if i in acked)


def idle_queries(conn: psycopg.Connection[Any], limits: Limits, seconds: float = 5.0) -> float:
    table = fresh_outbox(conn)
    store = PostgresStore.open(DSN, table)
    metrics = HarvesterMetrics()
    engine = Engine(
        store,
        at_least_once(store, lambda cb: KafkaPublisher(producer_config({"bootstrap.servers": BOOTSTRAP}, {}), cb)),
        limits,
        metrics,
        lambda e: None,
    )
    engine.start()
    engine.on_leader_event(LeaderAcquired(uuid.uuid4()))
    time.sleep(1.0)
    before = _marks(metrics)
    time.sleep(seconds)
    rate = (_marks(metrics) - before) / seconds
    stop(engine, store)
    return rate


def _marks(metrics: HarvesterMetrics) -> float:
    for m in metrics.registry.collect():
        if m.name == "harvester_mark_query_seconds":
            return next(s.value for s in m.samples if s.name.endswith("_count"))
    return 0.0


def pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(len(values) * p))] if values else float("nan")


def cleanup(conn: psycopg.Connection[Any]) -> None:
    for (name,) in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'bench\\_%'").fetchall():
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=100_000)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--rate", type=float, default=1000.0, help="insert rate of the latency phase (records/s)")
    p.add_argument("--seconds", type=float, default=15.0, help="duration of the steady and latency phases")
    p.add_argument("--mark-query-records", type=int, default=500)
    p.add_argument("--max-in-flight", type=int, default=5000)
    args = p.parse_args()
    limits = Limits(mark_query_records=args.mark_query_records, max_in_flight_records=args.max_in_flight)
    defaults = Limits()
    print(
        f"workload: {args.records} records, {args.keys} keys, {len(VALUE)}-byte values; "
        f"engine limits: mark_query_records={limits.mark_query_records} "
        f"max_in_flight_records={limits.max_in_flight_records}"
    )
    with psycopg.connect(DSN, autocommit=True) as conn:
        try:
            producer = ceiling_producer(args.records, args.keys)
            print(f"ceiling  confluent-kafka produce alone      {producer:10.0f} records/s")
            sqlonly = ceiling_sql(conn, args.records, args.keys, limits.mark_query_records)
            print(f"ceiling  mark+purge SQL alone                {sqlonly:10.0f} records/s")
            lower = min(producer, sqlonly)
            drained = drain_preloaded(conn, args.records, args.keys, limits)
            print(
                f"harvest  drain pre-loaded outbox            {drained:10.0f} records/s"
                f"  ({drained / lower:.0%} of lower ceiling)"
            )
            drained_d = drain_preloaded(conn, args.records, args.keys, defaults)
            print(
                f"harvest  drain, goharvest default limits    {drained_d:10.0f} records/s"
                "  (mark_query_records=100, max_in_flight=1000)"
            )
            inserted, harvested = steady(conn, args.keys, args.seconds, limits)
            print(f"harvest  steady inserts: inserted {inserted:8.0f}/s, harvested during inserts {harvested:8.0f}/s")
            lat = latency(conn, args.keys, args.rate, args.seconds, defaults)
            print(
                f"latency  commit->ack at {args.rate:.0f} records/s:"
                f" p50 {pct(lat, 0.5):.1f} ms  p99 {pct(lat, 0.99):.1f} ms"
                f"  max {max(lat):.1f} ms  (n={len(lat)}, mean {statistics.fmean(lat):.1f} ms)"
            )
            idle = idle_queries(conn, defaults)
            print(
                f"idle     mark queries per second: {idle:.2f}"
                f" (LISTEN/NOTIFY wake-up, back-off up to {defaults.max_mark_backoff.total_seconds()} s)"
            )
        finally:
            cleanup(conn)


if __name__ == "__main__":
    main()

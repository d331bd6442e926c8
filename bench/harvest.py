"""Drain throughput, cost per record and latency, next to the ceilings measured in the same run.

    ./dev.sh bench harvest [--backlogs 100000,1000000] [--keys 1000] [--burst 200000] [--rate 1000]
                           [--seconds 15] [--drains-only]

Prints:
  1. ceiling: confluent-kafka alone producing the records (same producer settings);
  2. per backlog: the SQL ceilings on the same pre-loaded outbox (mark + purge alone, and the
     single-write ``DELETE ... RETURNING`` drain, the limit of one connection), then the harvester
     draining it with goharvest's default limits and with tuned limits: records/s, the share of
     each ceiling, and CPU seconds per 1,000 records of the harvester process and of PostgreSQL;
     under each drain, where the database's work went: the buffers one read from the head of the id
     order touches early and late in the drain (EXPLAIN (ANALYZE, BUFFERS)), row versions written,
     vacuums, and WAL bytes per record;
  3. a burst COPied into an outbox that was empty while the harvester idled (default limits);
  4. the harvester under steady concurrent inserts;
  5. latency from insert commit to delivery ack at a fixed insert rate (p50/p99/max);
  6. queries per second of an idle harvester.
"""

from __future__ import annotations

import argparse
import statistics
import threading
import time
import uuid
from dataclasses import dataclass
from typing import Any

import psycopg
import workload
from confluent_kafka import Producer
from cpu import CpuMeter, per_thousand
from psycopg import sql
from workload import (
    VALUE,
    cleanup,
    copy_rows,
    fresh_outbox,
    fresh_topic,
    pct,
    preload,
    run_engine,
    stop,
    wait_empty,
    writer_loop,
)

from harvester import Engine, Limits, PostgresStore, TableName
from harvester.core.at_least_once import at_least_once
from harvester.core.metrics import HarvesterMetrics
from harvester.kafka.publisher import KafkaPublisher, producer_config
from leader.events import LeaderAcquired


def ceiling_producer(records: int, keys: int) -> float:
    topic = fresh_topic()
    producer = Producer(producer_config({"bootstrap.servers": workload.BOOTSTRAP}, {}))
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
    store = PostgresStore.open(workload.DSN, table)
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


def ceiling_delete(conn: psycopg.Connection[Any], records: int, keys: int, batch: int) -> float:
    """One connection draining the outbox with one write per record: ``DELETE ... RETURNING`` of the
    head, ``batch`` rows a statement (no fence, no publishing: the limit of a single connection)."""
    table = fresh_outbox(conn)
    preload(conn, table, "t", records, keys)
    drain = sql.SQL(
        "DELETE FROM {t} WHERE id = ANY(ARRAY(SELECT id FROM {t} ORDER BY id LIMIT %s))"
        " RETURNING id, create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values"
    ).format(t=table.ident)
    done = 0
    started = time.perf_counter()
    with psycopg.connect(workload.DSN, autocommit=True) as own:
        while rows := own.execute(drain, (batch,), prepare=True).fetchall():
            done += len(rows)
    elapsed = time.perf_counter() - started
    assert done == records
    return records / elapsed


@dataclass(frozen=True, slots=True)
class Drain:
    rate: float  # records/s
    cpu_own: float  # CPU seconds per 1,000 records: this process (the harvester)
    cpu_postgres: float  # ... and the PostgreSQL server
    evidence: str  # where the database's work goes (see Probe)


class Probe:
    """Where PostgreSQL's work per record goes during a drain: the buffers one walk from the head
    of the id order touches (what a mark reads) early and late, row versions written (updates, HOT
    or not, and deletes), vacuums, and WAL bytes per record."""

    def __init__(self, conn: psycopg.Connection[Any], table: TableName, records: int) -> None:
        self._conn, self._table, self._records = conn, table, records
        self._wal = self._lsn()
        self.buffers: list[int] = []

    def _lsn(self) -> int:
        row = self._conn.execute("SELECT pg_current_wal_lsn() - '0/0'::pg_lsn").fetchone()
        return int(row[0]) if row else 0

    def walk(self, batch: int) -> None:
        """EXPLAIN (ANALYZE, BUFFERS) of reading ``batch`` ids from the head, as the mark does."""
        head = sql.SQL("EXPLAIN (ANALYZE, BUFFERS, FORMAT JSON) SELECT id FROM {} ORDER BY id LIMIT %s")
        row = self._conn.execute(head.format(self._table.ident), (batch,)).fetchone()
        plan = row[0][0]["Plan"] if row else {}
        self.buffers.append(int(plan.get("Shared Hit Blocks", 0)) + int(plan.get("Shared Read Blocks", 0)))

    def report(self) -> str:
        wal = (self._lsn() - self._wal) / self._records
        self._conn.execute("SELECT pg_stat_force_next_flush()")
        row = self._conn.execute(
            "SELECT n_tup_upd, n_tup_hot_upd, n_tup_del, vacuum_count + autovacuum_count"
            " FROM pg_stat_user_tables WHERE relid = to_regclass(%s)",
            (self._table.quoted,),
        ).fetchone()
        upd, hot, deleted, vacuums = row if row else (0, 0, 0, 0)
        walks = "/".join(str(b) for b in self.buffers) or "-"
        return (
            f"buffers per head walk early/late {walks}; updates {upd} ({hot} HOT), deletes {deleted},"
            f" vacuums {vacuums}; WAL {wal:.0f} bytes/record"
        )


def drain_preloaded(conn: psycopg.Connection[Any], records: int, keys: int, limits: Limits) -> Drain:
    table, topic = fresh_outbox(conn), fresh_topic()
    preload(conn, table, topic, records, keys)
    meter = CpuMeter(conn)
    probe = Probe(conn, table, records)
    before = meter.sample()
    started = time.perf_counter()
    metrics = HarvesterMetrics()
    engine, store = run_engine(table, limits, metrics=metrics)
    time.sleep(0.5)
    probe.walk(limits.mark_sizes[1])
    while metrics.purged._value.get() < records * 0.9 and time.perf_counter() - started < 900:
        time.sleep(0.02)
    probe.walk(limits.mark_sizes[1])
    wait_empty(conn, table)
    elapsed = time.perf_counter() - started
    after = meter.sample()
    stop(engine, store)
    return Drain(records / elapsed, *per_thousand(before, after, records), probe.report())


def burst_into_idle(conn: psycopg.Connection[Any], records: int, keys: int, limits: Limits) -> float:
    """Records/s from the commit of a COPY into an outbox that was empty (and never analysed) while
    the harvester idled, to the outbox being empty again."""
    table, topic = fresh_outbox(conn), fresh_topic()
    engine, store = run_engine(table, limits)
    time.sleep(3.0)  # idle marks: enough for PostgreSQL to consider generic plans
    copy_rows(conn, table, topic, records, keys)
    started = time.perf_counter()
    wait_empty(conn, table)
    elapsed = time.perf_counter() - started
    stop(engine, store)
    return records / elapsed


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
    store = PostgresStore.open(workload.DSN, table)
    metrics = HarvesterMetrics()
    engine = Engine(
        store,
        at_least_once(
            store, lambda cb: KafkaPublisher(producer_config({"bootstrap.servers": workload.BOOTSTRAP}, {}), cb)
        ),
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


def backlog_rows(conn: psycopg.Connection[Any], backlog: int, keys: int, tuned: Limits, producer: float) -> None:
    """The ceilings and both drains at one backlog, each drain as a share of the ceilings."""
    batch = tuned.mark_sizes[1]
    mark_purge = ceiling_sql(conn, backlog, keys, batch)
    cleanup(conn)
    single = ceiling_delete(conn, backlog, keys, batch)
    cleanup(conn)
    print(f"backlog {backlog}")
    print(f"  ceiling  mark+purge SQL alone              {mark_purge:10.0f} records/s")
    print(f"  ceiling  single-write DELETE ... RETURNING {single:10.0f} records/s")
    for name, limits in (("default limits (auto)", Limits()), ("goharvest's 100 / 1000", GOHARVEST), ("tuned", tuned)):
        d = drain_preloaded(conn, backlog, keys, limits)
        cleanup(conn)
        print(
            f"  harvest  drain, {name:<24} {d.rate:10.0f} records/s"
            f"  {d.rate / mark_purge:4.0%} of mark+purge, {d.rate / single:4.0%} of single-write,"
            f" {d.rate / producer:4.0%} of producer;"
            f" CPU s/1000 records: harvester {d.cpu_own:.3f}, PostgreSQL {d.cpu_postgres:.3f}"
        )
        print(f"           {d.evidence}")


# goharvest's documented defaults, set explicitly (this project's defaults are 'auto').
GOHARVEST = Limits(mark_query_records=100, max_in_flight_records=1000)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--backlogs", default="100000,1000000", help="comma-separated pre-loaded backlogs")
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--burst", type=int, default=200_000, help="records COPied into an idle outbox")
    p.add_argument("--rate", type=float, default=1000.0, help="insert rate of the latency phase (records/s)")
    p.add_argument("--seconds", type=float, default=15.0, help="duration of the steady and latency phases")
    p.add_argument("--mark-query-records", type=int, default=500, help="tuned limits")
    p.add_argument("--max-in-flight", type=int, default=5000, help="tuned limits")
    p.add_argument(
        "--drains-only",
        action="store_true",
        help="only the default-limits drain of each backlog, with its evidence line (to compare two trees:"
        " run this file with another checkout first on PYTHONPATH)",
    )
    args = p.parse_args()
    backlogs = [int(b) for b in args.backlogs.split(",")]
    tuned = Limits(mark_query_records=args.mark_query_records, max_in_flight_records=args.max_in_flight)
    defaults = Limits()
    first, largest = defaults.mark_sizes
    print(
        f"workload: {args.keys} keys, {len(VALUE)}-byte values; limits as mark_query_records / max_in_flight_records:"
        f" default 'auto' ({first}..{largest} / {defaults.in_flight_bound}), goharvest's defaults 100 / 1000,"
        f" tuned {tuned.mark_query_records} / {tuned.max_in_flight_records}"
    )
    with psycopg.connect(workload.DSN, autocommit=True) as conn:
        if args.drains_only:
            try:
                for backlog in backlogs:
                    d = drain_preloaded(conn, backlog, args.keys, defaults)
                    cleanup(conn)
                    print(
                        f"backlog {backlog}: drain, default limits {d.rate:10.0f} records/s;"
                        f" CPU s/1000 records: harvester {d.cpu_own:.3f}, PostgreSQL {d.cpu_postgres:.3f}"
                    )
                    print(f"           {d.evidence}")
            finally:
                cleanup(conn)
            return
        try:
            producer = ceiling_producer(min(backlogs), args.keys)
            print(f"ceiling  confluent-kafka produce alone      {producer:10.0f} records/s")
            for backlog in backlogs:
                backlog_rows(conn, backlog, args.keys, tuned, producer)
            burst = burst_into_idle(conn, args.burst, args.keys, defaults)
            cleanup(conn)
            print(f"harvest  burst of {args.burst} into an idle outbox, default limits: {burst:10.0f} records/s")
            inserted, harvested = steady(conn, args.keys, args.seconds, tuned)
            cleanup(conn)
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

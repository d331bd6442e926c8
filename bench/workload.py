"""What the benchmarks share: the services they connect to, a fresh outbox and topic, rows COPied
into it or inserted at a rate, an engine leading over it at once, waiting for the outbox to drain,
and the clean-up of every benchmark schema.

A benchmark that runs its own services sets ``DSN`` (and ``PRODUCER``, the harvester's producer
settings) here, before it calls these helpers: they read them from this module at each call.
"""

from __future__ import annotations

import os
import time
import uuid
from typing import Any

import psycopg
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from psycopg import sql

from harvester import Engine, Limits, PostgresStore, TableName, migrate
from harvester.compose import publisher
from harvester.core.at_least_once import at_least_once
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import DeliveryCallback, DeliveryReport, Publisher
from harvester.kafka.publisher import producer_config
from harvester.runtime import tune_garbage_collector
from leader.events import LeaderAcquired

DSN = os.environ.get(
    "HARVESTER_TEST_PG_DSN", "host=127.0.0.1 port=5432 user=harvester password=local-dev-secret dbname=harvester"
)
BOOTSTRAP = os.environ.get("HARVESTER_TEST_KAFKA", "127.0.0.1:9092")
# producerKafkaConfig of run_engine's harvester (a bench may set it, as it sets DSN).
PRODUCER: dict[str, str] = {}
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


def copy_rows(conn: psycopg.Connection[Any], table: TableName, topic: str, records: int, keys: int) -> None:
    """COPY ``records`` rows (``VALUE``, keys cycling over ``keys``) into ``table`` in one transaction."""
    with conn.transaction():
        copy_part(conn, table, topic, range(records), keys)


def copy_part(conn: psycopg.Connection[Any], table: TableName, topic: str, rows: range, keys: int) -> None:
    """COPY the rows numbered ``rows`` (row i's key: ``key<i % keys>``) into ``table``, in the
    transaction the caller opened."""
    copy = sql.SQL("COPY {} (create_time, kafka_topic, kafka_key, kafka_value) FROM STDIN").format(table.ident)
    with conn.cursor().copy(copy) as cp:
        created = time.strftime("%Y-%m-%d %H:%M:%S+00", time.gmtime())
        for i in rows:
            cp.write_row((created, topic, f"key{i % keys}", VALUE))


def preload(conn: psycopg.Connection[Any], table: TableName, topic: str, records: int, keys: int) -> None:
    copy_rows(conn, table, topic, records, keys)
    conn.execute(sql.SQL("VACUUM ANALYZE {}").format(table.ident))
    # Each timed phase starts a checkpoint cycle of its own, so none pays for another's full-page writes.
    conn.execute("CHECKPOINT")


def timed(callback: DeliveryCallback, acked: dict[int, float]) -> DeliveryCallback:
    """``callback``, recording each record's acknowledgement time first, for end-to-end latency."""

    def report(delivery: DeliveryReport) -> None:
        if delivery[1] is None:
            acked[delivery[0].id] = time.time()
        callback(delivery)

    return report


def run_engine(
    table: TableName,
    limits: Limits,
    acked: dict[int, float] | None = None,
    metrics: HarvesterMetrics | None = None,
    store: PostgresStore | None = None,
) -> tuple[Engine, PostgresStore]:
    """An engine leading at once over ``store`` (default: a mark-purge store of ``table``), in a
    process whose garbage collector is set as the reaper sets its own; with ``acked``, each record's
    acknowledgement time goes there (a callback per record: CPU the relay pays)."""
    tune_garbage_collector()
    if store is None:
        store = PostgresStore.open(DSN, table, vacuum_every=limits.vacuum_every_records)
    config = producer_config({"bootstrap.servers": BOOTSTRAP}, PRODUCER)
    in_order = store.release_on_ack

    def factory(cb: DeliveryCallback) -> Publisher:
        return publisher(config, cb if acked is None else timed(cb, acked), in_order=in_order)

    engine = Engine(store, at_least_once(store, factory), limits, metrics or HarvesterMetrics(), lambda e: None)
    engine.start()
    engine.on_leader_event(LeaderAcquired(uuid.uuid4()))
    return engine, store


def stop(engine: Engine, store: PostgresStore) -> None:
    engine.stop_marking()
    engine.drain(30)
    engine.close(10)
    store.close()


def wait_empty(conn: psycopg.Connection[Any], table: TableName, timeout: float = 900) -> None:
    """Poll cheaply (one row, not a count) until the outbox is empty."""
    probe = sql.SQL("SELECT 1 FROM {} LIMIT 1").format(table.ident)
    deadline = time.monotonic() + timeout
    while conn.execute(probe).fetchone() is not None and time.monotonic() < deadline:
        time.sleep(0.02)


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


def pct(values: list[float], p: float) -> float:
    return values[min(len(values) - 1, int(len(values) * p))] if values else float("nan")


def cleanup(conn: psycopg.Connection[Any]) -> None:
    """Drop every benchmark outbox: one left full of dead rows would keep autovacuum busy (and the
    machine's CPU) during the next measurement."""
    for (name,) in conn.execute("SELECT nspname FROM pg_namespace WHERE nspname LIKE 'bench\\_%'").fetchall():
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))

"""The relays bench/peers.py compares, each over an outbox of its own: Debezium's connector with
its EventRouter in Kafka Connect, and the harvester in-process with each of its sources; a burst
through each, with the CPU and resident memory it cost."""

from __future__ import annotations

import contextlib
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
import workload
from confluent_kafka import Consumer, TopicPartition
from cpu import CollectorTime, CpuMeter, kinds_per_thousand, own_seconds
from debezium_connect import (
    ConnectWorker,
    assert_running,
    connector_config,
    streaming_connector,
)
from peer_bursts import (
    GOHARVEST_DDL,
    MARK_PURGE,
    MESSAGES,
    RETAIN,
    RETENTION,
    Burst,
    Source,
    autovacuums,
    copy_burst,
    emit_burst,
    topic_count,
    wait_confirmed,
    wait_published,
)
from peer_services import BOOTSTRAP, PARTITIONS, LogicalPostgres, drop_slot
from psycopg import sql
from rss import PeakRss, own_pids
from steady import Steady, steady
from workload import VALUE, fresh_outbox, fresh_topic, run_engine, stop, wait_empty

from harvester import Limits, TableName
from harvester.compose import log_store as compose_log_store
from harvester.postgres.log import logical
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.store import LogStore
from harvester.postgres.schema import migrations
from harvester.postgres.schema.message_format import default_prefix


@dataclass(frozen=True, slots=True)
class Relay:
    """A relay running over an outbox of its own: where records go in and come out, and its CPU."""

    table: TableName
    topic: str
    cpu: Callable[[], float]  # CPU seconds of the relay's process so far
    in_process: bool  # the harvester runs in this process; Debezium in the Connect JVM
    prefix: str | None = None  # a table-less outbox's message prefix (records go in as messages)
    slot: str | None = None  # the harvester's slot with a log source
    keeps: bool = False  # delivered rows stay in the table (a retention window)


RelayContext = contextlib.AbstractContextManager[Relay]


@contextlib.contextmanager
def debezium_relay(conn: psycopg.Connection[Any], pg: LogicalPostgres, connect: ConnectWorker) -> Iterator[Relay]:
    """Debezium's connector with the EventRouter, streaming from a fresh goharvest outbox."""
    name = f"peers_{uuid.uuid4().hex[:8]}"
    table = TableName(name, "outbox")
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    conn.execute(sql.SQL(GOHARVEST_DDL).format(table.ident))
    topic = fresh_topic(PARTITIONS)
    try:
        with streaming_connector(conn, connect, name, connector_config(name, pg.dsn, table)):
            time.sleep(3.0)  # idle, as the harvester idles before its burst
            yield Relay(table, topic, connect.cpu, in_process=False)
    finally:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def debezium_burst(
    conn: psycopg.Connection[Any],
    pg: LogicalPostgres,
    connect: ConnectWorker,
    records: int,
    keys: int,
    check: bool,
    spread: float = 0.0,
) -> Burst:
    with debezium_relay(conn, pg, connect) as relay:
        consumer = Consumer(
            {"bootstrap.servers": BOOTSTRAP, "group.id": f"{relay.topic}_count", "enable.auto.commit": False}
        )
        try:
            meter = CpuMeter(conn, without_own=True)
            before, relay_before = meter.sample(), connect.cpu()
            pid = connect.proc.pid if connect.proc else 0
            rss, heap_mark = PeakRss(lambda: [pid]), connect.heap_mark()
            committed = copy_burst(conn, relay.table, relay.topic, records, keys, spread)
            schema = relay.table.schema
            assert schema is not None  # fresh_outbox's
            elapsed = (
                wait_published(consumer, relay.topic, records, lambda: assert_running(connect, schema)) - committed
            )
            after, relay_after = meter.sample(), connect.cpu()
            rss_peak, heap = rss.peak(), connect.heap_since(heap_mark)
            vacuums = autovacuums(conn, relay.table)
            if check:
                _check_record(relay.topic)
            time.sleep(1.0)
            extra = topic_count(consumer, relay.topic) - records
        finally:
            consumer.close()
    scale = 1000 / records
    return Burst(
        records / elapsed,
        (relay_after - relay_before) * scale,
        (after.postgres - before.postgres) * scale,
        (after.walsender - before.walsender) * scale,
        (after.broker - before.broker) * scale,
        extra=extra,
        autovacuums=vacuums,
        rss_start=rss.resident,
        rss_peak=rss_peak,
        rss_exact=rss.exact,
        jvm_heap=heap,
        cpu_postgres_kinds=kinds_per_thousand(before, after, records),
    )


def _check_record(topic: str) -> None:
    """The EventRouter put kafka_key in the key and kafka_value, unchanged, in the value."""
    c = Consumer(
        {
            "bootstrap.servers": BOOTSTRAP,
            "group.id": f"check_{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = c.poll(1.0)
            if msg is None or msg.error():
                continue
            key, value = (msg.key() or b"").decode(), (msg.value() or b"").decode()
            if not key.startswith("key") or value != VALUE:
                raise RuntimeError(f"Debezium's record is not the row's key/value: key={key!r} value={value[:60]!r}")
            return
        raise RuntimeError(f"could not read back a record of {topic}")
    finally:
        c.close()


@contextlib.contextmanager
def harvester_relay(
    conn: psycopg.Connection[Any], limits: Limits, source: Source, memory: int = 1 << 30
) -> Iterator[Relay]:
    """The harvester in-process over a fresh outbox with ``source`` (with the log, its publication
    and slot made first, and ``memory`` its logTransactionMemory; table-less, the outbox's table
    stays empty)."""
    table, topic = fresh_outbox(conn), fresh_topic(PARTITIONS)
    prefix = default_prefix(table) if source == MESSAGES else None
    # The bench's server is a single one: no failover to lose a table-less outbox's records.
    setup = LogSetup(table, f"{table.schema}_slot", f"{table.schema}_pub", prefix, accept_loss=True)
    log_store: LogStore | None = None
    if source != MARK_PURGE:
        migrations.ensure(conn, table, "fence")
        logical.create(conn, setup)
        every = limits.vacuum_every_records
        retention = RETENTION if source == RETAIN else None
        log_store = compose_log_store(
            workload.DSN, setup, retention=retention, vacuum_every=every, transaction_memory=memory
        )
        log_store.prepare()
    engine, store = run_engine(table, limits, store=log_store)
    try:
        time.sleep(3.0)  # idle marks: enough for PostgreSQL to consider generic plans
        slot = setup.slot if source != MARK_PURGE else None
        yield Relay(table, topic, own_seconds, in_process=True, prefix=prefix, slot=slot, keeps=source == RETAIN)
    finally:
        stop(engine, store)
        if source != MARK_PURGE:
            drop_slot(conn, setup.slot, setup.publication)
        assert table.schema is not None  # fresh_outbox's
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(table.schema)))


def harvester_burst(
    conn: psycopg.Connection[Any],
    records: int,
    keys: int,
    limits: Limits,
    source: Source = MARK_PURGE,
    spread: float = 0.0,
) -> Burst:
    consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": "harvester_count", "enable.auto.commit": False})
    with harvester_relay(conn, limits, source) as relay, contextlib.closing(consumer):
        meter = CpuMeter(conn, without_own=True)
        before = meter.sample()
        rss = PeakRss(own_pids)
        if relay.prefix is None:
            committed = copy_burst(conn, relay.table, relay.topic, records, keys, spread)
        else:
            committed = emit_burst(conn, relay.prefix, relay.topic, records, keys)
        own_after_copy = own_seconds()
        with CollectorTime() as collector:
            published = wait_published(consumer, relay.topic, records)
            if relay.prefix is None and not relay.keeps:
                # The table is probed only once all is published: a probe during the drain walks
                # the heap's dead rows from its start, PostgreSQL work the harvester does not do.
                wait_empty(conn, relay.table)
            else:  # nothing deleted now: done once the slot is confirmed past the burst
                row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
                assert relay.slot is not None and row is not None
                wait_confirmed(conn, relay.slot, str(row[0]))
        empty = time.time() - committed
        after, rss_peak = meter.sample(), rss.peak()
        cpu_swept = rate_swept = None
        if relay.keeps:  # and until the window's bulk delete emptied the outbox
            wait_empty(conn, relay.table)
            rate_swept = records / (time.time() - committed)
            cpu_swept = (meter.sample().postgres - before.postgres) * 1000 / records
        vacuums = autovacuums(conn, relay.table)
    scale = 1000 / records
    # The relay's CPU: this process after the commit (the COPY's client side ran before it).
    return Burst(
        records / (published - committed),
        (after.own - own_after_copy) * scale,
        (after.postgres - before.postgres) * scale,
        (after.walsender - before.walsender) * scale,
        (after.broker - before.broker) * scale,
        rate_empty=records / empty,
        cpu_postgres_swept=cpu_swept,
        rate_swept=rate_swept,
        autovacuums=vacuums,
        gc_seconds=collector.seconds * scale,
        gc_collections=collector.collections,
        rss_start=rss.resident,
        rss_peak=rss_peak,
        rss_exact=rss.exact,
        cpu_postgres_kinds=kinds_per_thousand(before, after, records),
    )


def steady_through(relay: Relay, rate: float, seconds: float, keys: int) -> Steady:
    return steady(
        workload.DSN,
        BOOTSTRAP,
        relay.table,
        relay.topic,
        PARTITIONS,
        relay.cpu,
        in_process=relay.in_process,
        rate=rate,
        seconds=seconds,
        keys=keys,
        prefix=relay.prefix,
    )

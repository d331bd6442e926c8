"""A burst into an idle outbox, as bench/peers.py writes it and times its relays: the workload
(a COPY of goharvest-layout rows in one transaction, or logical messages for a table-less outbox),
each relay's figures (Burst), and the probes that tell when it is done from outside the relay's hot
path (the topic's end offsets, the slot's confirmed position, the outbox emptied)."""

from __future__ import annotations

import time
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import psycopg
import workload
from confluent_kafka import Consumer, TopicPartition
from debezium_connect import JvmHeap
from peer_services import PARTITIONS
from workload import VALUE

from harvester import OutboxRecord, TableName
from harvester.postgres.schema.message_format import encode

# The harvester's sources in this bench: rows marked and purged, rows read from the log, and a
# table-less outbox's logical messages read from the log.
Source = str
MARK_PURGE, LOG, RETAIN, MESSAGES = "mark_purge", "log", "retain", "messages"
# A burst's transaction spread over time (--spread) pauses after each of this many COPYs.
SPREAD_PARTS = 20
# The retention window of RETAIN: short, so that the bulk delete of the burst's rows runs within the
# round and its cost is measured (a long window defers it past the round). Each sweep scans the
# table: in a burst, the burst's rows are scanned a few times before they are deleted (a long
# window scans a row about twice), so this figure is an upper bound of the sweep's cost.
RETENTION = 2.0


@dataclass(frozen=True, slots=True)
class Burst:
    rate: float  # records/s, commit to the last record on the topic (the sum of its end offsets)
    cpu_relay: float  # CPU s per 1,000 records: the relay process
    cpu_postgres: float  # ... and the PostgreSQL server
    cpu_walsender: float  # ... of which its WAL senders
    cpu_broker: float  # ... and the Kafka broker
    rate_empty: float | None = None  # harvester only: commit to empty outbox (or slot confirmed)
    extra: int = 0  # records beyond N on the topic (at-least-once duplicates)
    # A retention window: PostgreSQL CPU s per 1,000 records until the bulk delete emptied the
    # outbox (cpu_postgres then stops at delivery: the slot confirmed past the burst), and the rate
    # from the commit to then.
    cpu_postgres_swept: float | None = None
    rate_swept: float | None = None
    autovacuums: int = 0  # autovacuum/autoanalyze runs on the outbox counted within the measurement
    # In-process harvester: CPU s per 1,000 records spent in garbage collections (part of cpu_relay),
    # and how many ran, from the commit to the last record.
    gc_seconds: float | None = None
    gc_collections: int = 0
    # Resident memory of the relay's processes (MiB; rss.py): when the write began, and their peak
    # from then to the end of the measurement (exact: the peak could be reset at the start).
    rss_start: float = 0.0
    rss_peak: float = 0.0
    rss_exact: bool = True
    jvm_heap: JvmHeap | None = None  # Debezium: its JVM's heap over the same span
    # cpu_postgres by kind of server process (cpu.kinds_per_thousand): walsender, backend, autovacuum...
    cpu_postgres_kinds: dict[str, float] = field(default_factory=dict)


GOHARVEST_DDL = """CREATE TABLE {} (
  id BIGSERIAL PRIMARY KEY,
  create_time TIMESTAMPTZ NOT NULL DEFAULT now(),
  kafka_topic VARCHAR(249) NOT NULL,
  kafka_key VARCHAR(100) NOT NULL,
  kafka_value VARCHAR(10000),
  kafka_header_keys TEXT[] NOT NULL DEFAULT '{{}}',
  kafka_header_values TEXT[] NOT NULL DEFAULT '{{}}',
  leader_id UUID
)"""


def autovacuums(conn: psycopg.Connection[Any], table: TableName) -> int:
    """Autovacuum and autoanalyze runs on ``table`` so far (a fresh table: those within the round).
    The meter counts every backend of the server, so an autovacuum that runs within a relay's
    measurement is counted in its PostgreSQL CPU, one that runs after it is not, for every relay
    alike; this tells which ones had one."""
    row = conn.execute(
        "SELECT autovacuum_count + autoanalyze_count FROM pg_stat_user_tables WHERE relid = to_regclass(%s)",
        (table.quoted,),
    ).fetchone()
    return int(row[0]) if row else 0


def copy_burst(
    conn: psycopg.Connection[Any], table: TableName, topic: str, records: int, keys: int, spread: float = 0.0
) -> float:
    """COPY the burst in one transaction (pausing ``spread`` seconds in all between its parts: a
    writer the walsender's decoding keeps up with); return the commit's wall time."""
    if spread:
        with conn.transaction():
            part = -(-records // SPREAD_PARTS)
            for at in range(0, records, part):
                workload.copy_part(conn, table, topic, range(at, min(at + part, records)), keys)
                time.sleep(spread / SPREAD_PARTS)
    else:
        workload.copy_rows(conn, table, topic, records, keys)
    return time.time()


def emit_burst(conn: psycopg.Connection[Any], prefix: str, topic: str, records: int, keys: int) -> float:
    """Write the burst as logical messages in one transaction; return the commit's wall time."""
    payloads = [encode(OutboxRecord(topic=topic, key=f"key{i % keys}", value=VALUE)) for i in range(records)]
    emit = "SELECT count(pg_logical_emit_message(true, %s, p)) FROM unnest(%s::bytea[]) AS p"
    with conn.transaction():
        for at in range(0, records, 20_000):
            conn.execute(emit, (prefix, payloads[at : at + 20_000]))
    return time.time()


def wait_confirmed(conn: psycopg.Connection[Any], slot: str, lsn: str, timeout: float = 900) -> None:
    """Until ``slot`` is confirmed at or past ``lsn``."""
    probe = "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots WHERE slot_name = %s"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute(probe, (lsn, slot)).fetchone()
        if row is not None and row[0]:
            return
        time.sleep(0.02)


def topic_count(consumer: Consumer, topic: str) -> int:
    return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(PARTITIONS))


def wait_published(consumer: Consumer, topic: str, records: int, check: Callable[[], None] | None = None) -> float:
    """Wait, without asking the database, until ``topic`` holds ``records`` records; when (wall
    time). Every relay is measured so, from outside its hot path."""
    deadline = time.monotonic() + 900
    while (count := topic_count(consumer, topic)) < records:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} of {records} records on {topic} after 900 s")
        if check is not None:
            check()
        time.sleep(0.05)
    return time.time()

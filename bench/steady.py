"""A steady insert rate through a relay that is already running: commit-to-arrival latency and what
each record costs, measured the same way for every relay (bench/peers.py).

Writers insert 10-record transactions at a fixed total rate; every value is unique, so a consumer
reading the relay's topic maps each arriving message back to its commit. Latency is from the
writer's commit to the consumer's receipt (the consumer's overhead is the same for every relay).
"""

from __future__ import annotations

import statistics
import threading
import time
from collections.abc import Callable
from dataclasses import dataclass

import psycopg
from confluent_kafka import OFFSET_END, Consumer, TopicPartition
from cpu import CpuMeter
from psycopg import sql

from harvester import OutboxRecord, TableName
from harvester.postgres.schema.message_format import encode

VALUE_WIDTH = 100  # as the bursts' values


@dataclass(frozen=True, slots=True)
class Steady:
    inserted: float  # records/s committed by the writers
    p50_ms: float
    p99_ms: float
    cpu_relay: float  # CPU s per 1,000 records: the relay process
    cpu_postgres: float  # ... and the PostgreSQL server (the writers' backends included)
    missing: int  # records committed but not received within the wait


def _writer(
    dsn: str,
    table: TableName,
    topic: str,
    keys: int,
    rate: float,
    until: float,
    name: str,
    commits: dict[str, float],
    spent: list[float],
    prefix: str | None,
) -> None:
    emit = "SELECT count(pg_logical_emit_message(true, %s, p)) FROM unnest(%s::bytea[]) AS p"
    insert = sql.SQL(
        "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value)"
        " SELECT now(), %s, 'key' || ((%s + g) %% %s), rpad(%s || g, %s, 'x') FROM generate_series(1, 10) g"
    ).format(table.ident)
    n = 0
    with psycopg.connect(dsn, autocommit=True) as conn:
        next_at = time.monotonic()
        while time.monotonic() < until:
            start = f"{name}-{n}-"
            values = [(start + str(g)).ljust(VALUE_WIDTH, "x") for g in range(1, 11)]
            if prefix is None:
                conn.execute(insert, (topic, n, keys, start, VALUE_WIDTH))
            else:  # a table-less outbox: the same records as logical messages
                keyed = enumerate(values, 1)
                records = [OutboxRecord(topic=topic, key=f"key{(n + g) % keys}", value=v) for g, v in keyed]
                conn.execute(emit, (prefix, [encode(r) for r in records]))
            committed = time.time()
            for value in values:
                commits[value] = committed
            n += 10
            next_at += 10 / rate
            time.sleep(max(0.0, next_at - time.monotonic()))
    spent.append(time.thread_time())


def _receive(consumer: Consumer, arrivals: dict[str, float], stop: threading.Event, spent: list[float]) -> None:
    while not stop.is_set():
        for msg in consumer.consume(500, 0.1):
            if msg.error() is None:
                arrivals.setdefault((msg.value() or b"").decode(), time.time())
    spent.append(time.thread_time())


def steady(
    dsn: str,
    bootstrap: str,
    table: TableName,
    topic: str,
    partitions: int,
    relay_cpu: Callable[[], float],
    *,
    in_process: bool,
    rate: float,
    seconds: float,
    keys: int,
    writers: int = 2,
    prefix: str | None = None,
) -> Steady:
    """Insert at ``rate`` records/s for ``seconds`` into ``table`` (``prefix``: write them as
    logical messages with that prefix, a table-less outbox) while the relay moves them to
    ``topic``; wait (up to 60 s) for every record to arrive. ``in_process``: the relay runs in this
    process, whose CPU then excludes the writers' and the consumer's threads."""
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": f"steady-{topic}", "enable.auto.commit": False})
    consumer.assign([TopicPartition(topic, p, OFFSET_END) for p in range(partitions)])
    consumer.consume(1, 1.0)  # joins the partitions before the first insert
    commits: dict[str, float] = {}
    arrivals: dict[str, float] = {}
    stop = threading.Event()
    spent: list[float] = []  # CPU s of the writer and consumer threads
    receiver = threading.Thread(target=_receive, args=(consumer, arrivals, stop, spent), daemon=True)
    receiver.start()
    with psycopg.connect(dsn, autocommit=True) as conn:
        meter = CpuMeter(conn)
        before, relay_before = meter.sample(), relay_cpu()
        started = time.monotonic()
        until = started + seconds
        threads = [
            threading.Thread(
                target=_writer,
                args=(dsn, table, topic, keys, rate / writers, until, f"w{i}", commits, spent, prefix),
                daemon=True,
            )
            for i in range(writers)
        ]
        for t in threads:
            t.start()
        for t in threads:
            t.join()
        inserted = len(commits) / (time.monotonic() - started)
        deadline = time.monotonic() + 60
        # Only the writers' records are on the topic: counting arrivals is enough (and cheap, since
        # this thread's CPU counts as the in-process relay's).
        while len(arrivals) < len(commits) and time.monotonic() < deadline:
            time.sleep(0.05)
        after, relay_after = meter.sample(), relay_cpu()
    stop.set()
    receiver.join(5)
    consumer.close()
    relay = relay_after - relay_before - (sum(spent) if in_process else 0.0)
    latencies = sorted((arrivals[v] - c) * 1000 for v, c in commits.items() if v in arrivals)
    scale = 1000 / max(1, len(commits))
    return Steady(
        inserted=inserted,
        p50_ms=statistics.median(latencies) if latencies else float("nan"),
        p99_ms=latencies[min(len(latencies) - 1, int(len(latencies) * 0.99))] if latencies else float("nan"),
        cpu_relay=relay * scale,
        cpu_postgres=(after.postgres - before.postgres) * scale,
        missing=len(commits) - len(latencies),
    )

"""Concurrent outbox writers and an order/loss checker for engine tests."""

from __future__ import annotations

import threading
import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from dataclasses import dataclass, field

import psycopg
from confluent_kafka import Message
from psycopg import sql

from harvester import OutboxRecord, Stasher
from harvester.postgres.schema.identifiers import TableName


def write_concurrently(
    dsn: str, table: TableName, topic: str, keys: int, per_key: int, writers: int = 8, per_txn: int = 5
) -> dict[str, int]:
    """Each writer owns a disjoint set of keys and writes them in order, several records per
    transaction, concurrently with the others. Values are ``<key>:<seq>``. Returns records per key."""
    key_names = [f"k{i}" for i in range(keys)]

    def run(own: list[str]) -> None:
        stasher = Stasher(table)
        plan = [(k, s) for s in range(per_key) for k in own]
        with psycopg.connect(dsn) as conn:
            for i in range(0, len(plan), per_txn):
                with conn.transaction():
                    stasher.stash(
                        conn, [OutboxRecord(topic=topic, key=k, value=f"{k}:{s}") for k, s in plan[i : i + per_txn]]
                    )

    threads = [threading.Thread(target=run, args=(key_names[w::writers],)) for w in range(writers)]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    return {k: per_key for k in key_names}


@dataclass
class Verdict:
    """What a topic's contents say about loss, order and duplicates."""

    lost: list[str] = field(default_factory=list)
    out_of_order: list[str] = field(default_factory=list)
    duplicates: int = 0
    unexpected: int = 0


def check(messages: Sequence[Message], expected: dict[str, int]) -> Verdict:
    """Values are ``<key>:<seq>[:padding]``. Per key, first deliveries must be exactly seq 0..n-1
    in order; re-deliveries are counted."""
    seen: dict[str, list[int]] = defaultdict(list)
    verdict = Verdict()
    for m in messages:
        key = (m.key() or b"").decode()
        value = (m.value() or b"").decode()
        k, _, rest = value.partition(":")
        if k != key or key not in expected:
            verdict.unexpected += 1
            continue
        seen[key].append(int(rest.split(":")[0]))
    for key, n in expected.items():
        firsts: list[int] = []
        got: set[int] = set()
        for s in seen.get(key, []):
            if s in got:
                verdict.duplicates += 1
            else:
                got.add(s)
                firsts.append(s)
        if got != set(range(n)):
            verdict.lost.append(key)
        if firsts != sorted(firsts):
            verdict.out_of_order.append(key)
    return verdict


def wait_drained(dsn: str, table: TableName, timeout: float = 60.0) -> int:
    """Wait until the outbox is empty; return how many records remain (0 on success)."""
    deadline = time.monotonic() + timeout
    with psycopg.connect(dsn, autocommit=True) as conn:
        while True:
            row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone()
            left = int(row[0]) if row else -1
            if left == 0 or time.monotonic() > deadline:
                return left
            time.sleep(0.1)


def insert(dsn: str, table: TableName, rows: Sequence[tuple[str, str, str]]) -> None:
    """Insert (topic, key, value) rows in one transaction, in the given order."""
    with psycopg.connect(dsn) as conn:
        Stasher(table).stash(conn, [OutboxRecord(topic=t, key=k, value=v) for t, k, v in rows])


def wait_until(predicate: Callable[[], bool], timeout: float = 30.0) -> bool:
    """Poll ``predicate`` every 50 ms until it holds or ``timeout`` passes."""
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if predicate():
            return True
        time.sleep(0.05)
    return predicate()


def writing(dsn: str, table: TableName, topic: str, **kwargs: int) -> threading.Thread:
    """Start :func:`write_concurrently` in the background; join the returned thread to wait."""
    thread = threading.Thread(target=write_concurrently, args=(dsn, table, topic), kwargs=kwargs)
    thread.start()
    return thread

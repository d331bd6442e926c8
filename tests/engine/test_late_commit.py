"""A transaction that commits after records with higher ids (earlier log positions) were harvested is
still harvested, in every source and variant and both delivery modes, across a leader change too.

Ids come from the sequence at insert, not at commit: a relay that remembers "the highest id seen"
loses such rows, the classic flaw of polling relays. Mark-purge/reset marks every unmarked row,
whatever its id; the log source hands out whole transactions in commit order, whatever their rows'
ids or where they began in the log. Two late transactions take the lowest ids and stay open while
later ones commit and are harvested: one commits while the first leader leads, the other stays
open while that leader is killed and another takes over, and commits under the new one. Every
record arrives, each key's records in commit order, and exactly once none twice (``read_committed``).
A late write of the Spark sink, and the Spark drain's late commits, are in tests/spark_drain/test_late_commit.py
(they need its SparkSession)."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from confluent_kafka import Consumer, KafkaError, Message
from psycopg import sql

from harvester import MessageStasher, OutboxRecord, Stasher
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import ensure_shard_index
from tests.engine.workload import check, wait_until
from tests.log.conftest import log_outbox, logical_dsn, message_outbox, stored_done, tableless  # noqa: F401  (fixtures)
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.kafka import delete_topics, reader
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

KEYS = [f"k{i}" for i in range(8)]  # over every shard of four
PER_KEY = 2  # records of each key in each transaction


# variant -> (the outbox fixture, the database fixture, the harvester's settings)
VARIANTS: dict[str, tuple[str, str, dict[str, Any]]] = {
    "polling": ("outbox", "services", {}),
    "polling-shards": ("outbox", "services", {"shards": 4}),
    "log": ("log_outbox", "logical_dsn", {"source": "log"}),
    "retention": ("log_outbox", "logical_dsn", {"source": "log", "log_retention": "1s"}),
    "tableless": ("message_outbox", "logical_dsn", tableless()),
}


class Topic:
    """A read_committed consumer kept open over the test: what arrived so far, and waits for more."""

    def __init__(self, consumer: Consumer) -> None:
        self._consumer = consumer
        self.messages: list[Message] = []

    def _poll(self) -> None:
        for msg in self._consumer.consume(1000, 0.2):
            err = msg.error()
            if err is None:
                self.messages.append(msg)
            elif err.code() != KafkaError._PARTITION_EOF:
                raise RuntimeError(str(err))

    def distinct(self) -> int:
        return len({(m.value() or b"") for m in self.messages})

    def wait_for(self, count: int, timeout: float = 60.0) -> bool:
        """Until ``count`` distinct records arrived."""

        def arrived() -> bool:
            self._poll()
            return self.distinct() >= count

        return wait_until(arrived, timeout)

    def linger(self, seconds: float) -> None:
        """Read on for ``seconds``, to catch what arrives twice."""
        deadline = time.monotonic() + seconds
        while time.monotonic() < deadline:
            self._poll()


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
@pytest.mark.parametrize("variant", list(VARIANTS))
def test_late_transactions_are_harvested_in_commit_order_across_a_leader_change(
    request: pytest.FixtureRequest,
    services: Services,
    topics: Callable[..., str],
    variant: str,
    delivery: str,
) -> None:
    outbox_fixture, dsn_fixture, settings = VARIANTS[variant]
    table: TableName = request.getfixturevalue(outbox_fixture)
    dsn = services.pg_dsn if dsn_fixture == "services" else str(request.getfixturevalue(dsn_fixture))
    stasher = MessageStasher(table) if settings.get("log_messages") else Stasher(table)
    shards = int(settings.get("shards", 1))
    topic, group = topics(partitions=2), unique("late")

    # Commit order: early, late-in-term, early-after-the-change, late-across-the-change; each key's
    # seq follows it, so the two late ones, written first (lowest ids, earliest log positions), hold
    # each key's later seqs.
    def records(order: int) -> list[OutboxRecord]:
        seqs = range(order * PER_KEY, (order + 1) * PER_KEY)
        return [OutboxRecord(topic=topic, key=k, value=f"{k}:{s}") for s in seqs for k in KEYS]

    per_txn = len(KEYS) * PER_KEY

    def commit(order: int) -> None:
        with psycopg.connect(dsn) as conn:
            stasher.stash(conn, records(order))

    def settled(before: int) -> Callable[[], bool]:
        """Whether what arrived is also done in PostgreSQL: rows deleted, or the position stored."""
        if variant in ("retention", "tableless"):
            return lambda: stored_done(dsn, table) > before
        query = sql.SQL("SELECT count(*) FROM {}").format(table.ident)

        def empty() -> bool:
            with psycopg.connect(dsn, autocommit=True) as conn:
                row = conn.execute(query).fetchone()
            return row is not None and row[0] == 0

        return empty

    def position() -> int:
        return stored_done(dsn, table) if variant in ("retention", "tableless") else 0

    def leading(p: HarvesterProcess) -> bool:
        return {e["shard"] for e in list(p.events) if e["event"] == "LeaderAcquired"} == set(range(shards))

    def spawn(name: str) -> HarvesterProcess:
        spec = harvester_spec(dsn, services.bootstrap, table, group, name, delivery=delivery, **settings)
        return HarvesterProcess(spec)

    with psycopg.connect(dsn, autocommit=True) as conn:  # as reaper migrate does: built at start, it
        ensure_shard_index(conn, table, shards)  # would wait for the late transactions to end
    processes: list[HarvesterProcess] = []
    with (
        psycopg.connect(dsn) as across,
        psycopg.connect(dsn) as in_term,
        reader(services.bootstrap, [topic], **{"isolation.level": "read_committed"}) as consumer,
    ):
        got = Topic(consumer)
        stasher.stash(across, records(3))
        stasher.stash(in_term, records(1))
        try:
            first = spawn("first")
            processes.append(first)
            assert wait_until(lambda: leading(first), 60), first.log
            before = position()
            commit(0)
            assert got.wait_for(per_txn) and wait_until(settled(before))
            before = position()
            in_term.commit()
            assert got.wait_for(2 * per_txn) and wait_until(settled(before))
            first.proc.kill()  # while the other late transaction is open
            second = spawn("second")
            processes.append(second)
            assert wait_until(lambda: leading(second), 60), second.log
            commit(2)
            assert got.wait_for(3 * per_txn)
            before = position()
            across.commit()
            assert got.wait_for(4 * per_txn) and wait_until(settled(before))
            got.linger(1.0)
        finally:
            for p in processes:
                p.terminate()
            delete_topics(services.bootstrap, [f"{group}.neli", f"{group}.checkpoints"])
    verdict = check(got.messages, {k: 4 * PER_KEY for k in KEYS})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0, verdict
    if delivery == "exactly_once":
        assert verdict.duplicates == 0

"""Exactly-once mode: batches and checkpoints commit together; recovery purges what was committed;
a zombie's producer is fenced; read_committed consumers see every record once, in key order."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harvester import Harvester, HarvesterConfig, Limits, PostgresStore
from harvester.core.protocols import ProducerFencedError
from harvester.core.records import MarkedRecord
from harvester.kafka.publisher import producer_config
from harvester.kafka.topics import ensure_topic
from harvester.kafka.transactions import KafkaTransactionalPublisher, read_checkpoints
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table
from tests.engine.workload import check, insert, wait_drained, wait_until, write_concurrently, writing
from tests.proc.processes import HarvesterProcess, blocked_statement, harvester_spec
from tests.support.harvesters import ManualElector
from tests.support.kafka import delete_topics, read_messages, reader
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

# Consumer configuration, passed as read_messages(..., **COMMITTED).
COMMITTED: dict[str, Any] = {"isolation.level": "read_committed"}


def eos_config(services: Services, outbox: TableName, group: str, **limits: object) -> HarvesterConfig:
    return HarvesterConfig(
        data_source=services.pg_dsn,
        outbox_table=outbox.qualified,
        base_kafka_config={"bootstrap.servers": services.bootstrap},
        leader_group_id=group,
        delivery="exactly_once",
        limits=Limits(**{"mark_query_records": 50, **limits}),  # type: ignore[arg-type]
    )


def wait_committed(bootstrap: str, topic: str, count: int) -> bool:
    """Until a read_committed consumer has read ``count`` records of ``topic``."""
    seen = 0
    with reader(bootstrap, [topic], **COMMITTED) as consumer:

        def enough() -> bool:
            nonlocal seen
            seen += sum(1 for m in consumer.consume(1000, 0.2) if m.error() is None)
            return seen >= count

        return wait_until(enough, timeout=60)


def count(dsn: str, table: TableName) -> int:
    with psycopg.connect(dsn) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone()
    return int(row[0]) if row else -1


def epoch(dsn: str, table: TableName) -> int:
    """The epoch of ``table``'s fence row: the term that holds it."""
    with psycopg.connect(dsn) as conn:
        query = sql.SQL("SELECT epoch FROM {} WHERE outbox_table = %s").format(fence_table(table).ident)
        row = conn.execute(query, (table.qualified,)).fetchone()
    return int(row[0]) if row else 0


def test_read_committed_consumer_sees_each_record_once_in_key_order(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    topic, group = topics(partitions=3), unique("eos")
    h = Harvester(eos_config(services, outbox, group), elector=ManualElector())
    h.start()
    try:
        expected = write_concurrently(services.pg_dsn, outbox, topic, keys=100, per_key=10, writers=4)
        assert wait_drained(services.pg_dsn, outbox) == 0
    finally:
        h.stop(timeout=10)
    verdict = check(read_messages(services.bootstrap, [topic], 1000, **COMMITTED), expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0
    assert h.metrics.transactions_committed._value.get() >= 20  # batches of at most 50
    checkpoints, _ = read_checkpoints({"bootstrap.servers": services.bootstrap}, f"{group}.checkpoints", 0)
    assert sorted(i for c in checkpoints for i in c.ids) == sorted(set(i for c in checkpoints for i in c.ids))
    delete_topics(services.bootstrap, [f"{group}.checkpoints"])


def test_new_leader_purges_committed_batch_before_marking(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    """A leader committed a transaction and died before purging: its successor re-reads the
    checkpoint, purges those records and never publishes them again."""
    topic, group = topics(), unique("eos")
    insert(services.pg_dsn, outbox, [(topic, f"k{i}", f"k{i}:0") for i in range(5)])
    kafka = producer_config({"bootstrap.servers": services.bootstrap}, {})
    ensure_topic(kafka, f"{group}.checkpoints")
    crashed = PostgresStore.open(services.pg_dsn, outbox)
    leader = uuid.uuid4()
    crashed.acquire(leader)
    batch: list[MarkedRecord] = crashed.mark(leader, 3)  # the "dead" leader's batch: k0..k2
    crashed.close()
    txn = KafkaTransactionalPublisher(kafka, f"{group}.harvester", f"{group}.checkpoints")
    txn.init()
    txn.publish_batch(batch, 1)  # committed, never purged
    txn.close(5)
    h = Harvester(eos_config(services, outbox, group), elector=ManualElector())
    h.start()
    try:
        assert wait_drained(services.pg_dsn, outbox) == 0
    finally:
        h.stop(timeout=10)
    got = read_messages(services.bootstrap, [topic], 5, **COMMITTED)
    assert sorted((m.value() or b"").decode() for m in got) == [f"k{i}:0" for i in range(5)]  # each once
    assert h.metrics.recoveries._value.get() == 1
    assert h.metrics.published._value.get() == 2  # only k3 and k4 were left to publish
    delete_topics(services.bootstrap, [f"{group}.checkpoints"])


def test_zombie_producer_is_fenced_by_the_new_leader(services: Services, topics: Callable[..., str]) -> None:
    topic, group = topics(), unique("eos")
    kafka = producer_config({"bootstrap.servers": services.bootstrap}, {})
    ensure_topic(kafka, f"{group}.checkpoints")
    old = KafkaTransactionalPublisher(kafka, f"{group}.harvester", f"{group}.checkpoints")
    new = KafkaTransactionalPublisher(kafka, f"{group}.harvester", f"{group}.checkpoints")
    old.init()
    new.init()
    record = MarkedRecord(1, datetime.now(UTC), topic, "k", b"zombie", [])
    with pytest.raises(ProducerFencedError):
        old.publish_batch([record], 1)
    new.publish_batch([MarkedRecord(2, datetime.now(UTC), topic, "k", b"leader", [])], 2)
    assert [m.value() for m in read_messages(services.bootstrap, [topic], 1, **COMMITTED)] == [b"leader"]
    # Leadership comes back to the fenced process: its next term starts over with a new producer
    # (its dead one may not even be flushed) and fences the other in turn.
    old.init()
    with pytest.raises(ProducerFencedError):
        new.publish_batch([MarkedRecord(3, datetime.now(UTC), topic, "k", b"zombie again", [])], 3)
    old.publish_batch([MarkedRecord(4, datetime.now(UTC), topic, "k", b"leader again", [])], 4)
    got = [m.value() for m in read_messages(services.bootstrap, [topic], 2, **COMMITTED)]
    assert got == [b"leader", b"leader again"]
    old.close(1)
    new.close(1)
    delete_topics(services.bootstrap, [f"{group}.checkpoints"])


def test_sigkill_failover_delivers_exactly_once(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    topic, group = topics(partitions=2), unique("eos")

    def spec(name: str) -> dict[str, object]:
        return harvester_spec(
            services.pg_dsn,
            services.bootstrap,
            outbox,
            group,
            name,
            delivery="exactly_once",
            limits={"mark_query_records": 20},
        )

    a = HarvesterProcess(spec("first"))
    b: HarvesterProcess | None = None
    try:
        assert a.wait_for("LeaderAcquired"), a.log
        b = HarvesterProcess(spec("second"))
        writer = writing(services.pg_dsn, outbox, topic, keys=40, per_key=40, writers=4, per_txn=1)
        assert wait_committed(services.bootstrap, topic, 40)  # the kill lands after commits, mid-stream
        os.kill(a.proc.pid, signal.SIGKILL)
        assert b.wait_for("LeaderAcquired", timeout=30), b.log
        writer.join()
        assert wait_drained(services.pg_dsn, outbox, timeout=90) == 0
    finally:
        a.terminate()
        if b is not None:
            b.terminate()
        delete_topics(services.bootstrap, [f"{group}.neli", f"{group}.checkpoints"])
    verdict = check(read_messages(services.bootstrap, [topic], 1600, **COMMITTED), {f"k{i}": 40 for i in range(40)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0


def test_a_leader_fenced_between_commit_and_purge_publishes_nothing_twice(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    """The interleaving forced: the leader's purges wait on the fence row the test share-locks, so
    it commits batches to Kafka that stay in the outbox (two purges pending, the third batch waits
    for them); it is stopped there and its purge cancelled; the standby takes over, its recovery
    purging what the checkpoints name before it marks; only then does the old leader resume, and
    its retried purge is refused. A read_committed consumer sees every record once, in key order."""
    topic, group = topics(partitions=2), unique("eos")

    def spec(name: str) -> dict[str, object]:
        return harvester_spec(
            services.pg_dsn, services.bootstrap, outbox, group, name,
            delivery="exactly_once", limits={"mark_query_records": 20},
        )  # fmt: skip

    a = HarvesterProcess(spec("stopped-a"))
    b: HarvesterProcess | None = None
    held = psycopg.connect(services.pg_dsn)
    try:
        assert a.wait_for("LeaderAcquired"), a.log
        b = HarvesterProcess(spec("standby-b"))
        assert b.wait_for("started")
        # The term's start bumps the fence row after LeaderAcquired: the share lock taken before it
        # would hold the leader's term back, not its purges.
        assert wait_until(lambda: any("fence_acquired" in line for line in a.log)), a.log
        fence = sql.SQL("SELECT 1 FROM {} WHERE outbox_table = %s FOR SHARE").format(fence_table(outbox).ident)
        held.execute(fence, (outbox.qualified,))
        insert(services.pg_dsn, outbox, [(topic, f"k{i % 20}", f"k{i % 20}:{i // 20}") for i in range(200)])
        assert wait_committed(services.bootstrap, topic, 60), a.log[-30:]  # three batches of 20
        assert wait_until(lambda: blocked_statement(services.pg_dsn, "stopped-a") is not None), a.log
        os.kill(a.proc.pid, signal.SIGSTOP)
        stopped = epoch(services.pg_dsn, outbox)
        blocked = blocked_statement(services.pg_dsn, "stopped-a")
        assert blocked is not None and "checkpoint_position" in blocked[1], blocked  # purge_checkpointed
        held.execute("SELECT pg_cancel_backend(%s)", (blocked[0],))
        held.rollback()
        assert count(services.pg_dsn, outbox) == 200  # committed to Kafka, none purged
        # LeaderAcquired comes before the term's bump of the fence row: the old leader resumes once
        # the new term holds it.
        assert b.wait_for("LeaderAcquired", timeout=30), b.log
        assert wait_until(lambda: epoch(services.pg_dsn, outbox) > stopped)
        os.kill(a.proc.pid, signal.SIGCONT)
        assert wait_drained(services.pg_dsn, outbox, timeout=60) == 0
        got = read_messages(services.bootstrap, [topic], 200, **COMMITTED)
    finally:
        held.close()
        a.terminate()
        if b is not None:
            b.terminate()
        delete_topics(services.bootstrap, [f"{group}.neli", f"{group}.checkpoints"])
    verdict = check(got, {f"k{i}": 10 for i in range(20)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0, verdict

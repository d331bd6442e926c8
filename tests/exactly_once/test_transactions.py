"""Exactly-once mode: batches and checkpoints commit together; recovery purges what was committed;
a zombie's producer is fenced; read_committed consumers see every record once, in key order."""

from __future__ import annotations

import os
import signal
import uuid
from collections.abc import Callable
from datetime import UTC, datetime
from typing import Any

import pytest

from harvester import Harvester, HarvesterConfig, Limits, PostgresStore
from harvester.core.protocols import ProducerFencedError
from harvester.core.records import MarkedRecord
from harvester.kafka.publisher import producer_config
from harvester.kafka.topics import ensure_topic
from harvester.kafka.transactions import KafkaTransactionalPublisher, read_checkpoints
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check, insert, wait_drained, wait_until, write_concurrently, writing
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support import ManualElector, Services, delete_topics, read_messages, reader, unique

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

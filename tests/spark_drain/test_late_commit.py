"""A transaction that commits late (its rows took lower ids than rows committed and harvested before
it) is still harvested when the Spark sink wrote it, and still drained by the Spark drain, which
reads the outbox itself (its offsets name the ids each micro-batch planned, not a position).

The other sources and variants are in tests/engine/test_late_commit.py; these need this directory's
local SparkSession."""

from __future__ import annotations

import random
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Message
from pyspark.sql import SparkSession

from harvester import OutboxRecord, Stasher
from harvester.core.identity import Identity
from harvester.postgres.schema.identifiers import TableName
from tests.engine.test_late_commit import Topic
from tests.engine.workload import check, insert, wait_drained, wait_until
from tests.spark_drain.conftest import Drain
from tests.support.harvesters import HarvesterFactory
from tests.support.kafka import consumed_headers, reader
from tests.support.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]  # the first test in a worker starts the session

KEYS = [f"k{i}" for i in range(6)]
PER_KEY = 3  # records of each key in each of the two transactions


def records(topic: str, order: int) -> list[tuple[str, str, str]]:
    """(topic, key, value) of the transaction committed ``order``-th: each key's seqs follow commit order."""
    return [(topic, k, f"{k}:{s}") for s in range(order * PER_KEY, (order + 1) * PER_KEY) for k in KEYS]


def ids(messages: list[Message], order: int) -> list[int]:
    """The outbox ids of the ``order``-th transaction's records among ``messages``."""
    seqs = range(order * PER_KEY, (order + 1) * PER_KEY)
    out = []
    for msg in messages:
        identity = Identity.from_headers(consumed_headers(msg))
        assert identity is not None
        if int((msg.value() or b"").decode().split(":")[1]) in seqs:
            out.append(identity.id)
    return out


def verdict(messages: list[Message]) -> None:
    """Every record arrived, each key's in commit order; the late ones hold the lower ids."""
    found = check(messages, {k: 2 * PER_KEY for k in KEYS})
    assert found.lost == [] and found.out_of_order == [] and found.unexpected == 0, found
    assert max(ids(messages, 1)) < min(ids(messages, 0))


def test_a_spark_write_that_commits_late_is_harvested(
    spark: SparkSession,
    services: Services,
    outbox: TableName,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
) -> None:
    """The sink's commit transaction inserts its rows, then waits (its commitSql) on an advisory lock
    the test holds while a later transaction commits and is harvested; then it commits. (The write
    runs on the main thread: a Python data source is looked up in the session of the calling thread.)
    Harvested by polling: a relay that remembers the highest id seen loses such rows; the log source
    orders by commit whoever wrote, as tests/engine/test_late_commit.py shows."""
    dsn, table = services.pg_dsn, outbox
    make_harvester()
    topic, lock = topics(partitions=2), random.randrange(1, 2**31)
    late = spark.createDataFrame([(k, v) for _, k, v in records(topic, 1)], "key string, value string")
    commit_sql = f"SELECT pg_advisory_xact_lock({lock})"
    waiting = "SELECT count(*) FROM pg_locks WHERE locktype = 'advisory' AND objid = %s AND NOT granted"
    with (
        psycopg.connect(dsn, autocommit=True) as gate,
        reader(services.bootstrap, [topic]) as consumer,
        ThreadPoolExecutor(1) as pool,
    ):
        got = Topic(consumer)
        gate.execute("SELECT pg_advisory_lock(%s)", (lock,))

        def early() -> None:
            """Once the write's commit transaction took its rows' ids and waits, commit and harvest
            a later one, then let the write commit."""
            try:
                with psycopg.connect(dsn, autocommit=True) as watch:
                    # A session's first write starts its Python workers: minutes on a loaded machine.
                    assert wait_until(lambda: watch.execute(waiting, (lock,)).fetchone() == (1,), 240)
                insert(dsn, table, records(topic, 0))
                assert got.wait_for(len(KEYS) * PER_KEY) and wait_drained(dsn, table) == 0
            finally:
                gate.execute("SELECT pg_advisory_unlock(%s)", (lock,))

        first = pool.submit(early)
        late.write.format("outbox").mode("append").options(
            dsn=dsn, table=table.qualified, topic=topic, commitSql=commit_sql
        ).save()
        first.result()
        assert got.wait_for(2 * len(KEYS) * PER_KEY) and wait_drained(dsn, table) == 0
        got.linger(1.0)
    verdict(got.messages)


def test_the_drain_takes_a_transaction_that_commits_late(
    services: Services, outbox: TableName, topics: Callable[..., str], drained: Drain, tmp_path: Path
) -> None:
    """One query runs throughout: it drains a later transaction while the late one is open, then
    the late one once it commits."""
    topic = topics(partitions=2)
    stream = drained(maxRecordsPerTrigger="10").selectExpr("topic", "key", "value", "headers", "partition")
    with psycopg.connect(services.pg_dsn) as late, reader(services.bootstrap, [topic]) as consumer:
        got = Topic(consumer)
        Stasher(outbox).stash(late, [OutboxRecord(topic=t, key=k, value=v) for t, k, v in records(topic, 1)])
        insert(services.pg_dsn, outbox, records(topic, 0))
        query: Any = (
            stream.writeStream.format("kafka")
            .option("kafka.bootstrap.servers", services.bootstrap)
            .option("checkpointLocation", str(tmp_path / "cp"))
            .trigger(processingTime="200 milliseconds")
            .start()
        )
        try:
            assert got.wait_for(len(KEYS) * PER_KEY, 120) and wait_drained(services.pg_dsn, outbox) == 0
            late.commit()
            assert got.wait_for(2 * len(KEYS) * PER_KEY) and wait_drained(services.pg_dsn, outbox) == 0
            got.linger(1.0)
        finally:
            query.stop()
    verdict(got.messages)

"""Draining an outbox with Spark micro-batches into Kafka through Spark's own Kafka sink. (A live
outbox, written while the query runs, is drained in test_leadership.py, with a reaper sharing it.)"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Message
from psycopg import sql
from pyspark.errors import StreamingQueryException
from pyspark.sql import DataFrame
from pyspark.sql.streaming.query import StreamingQuery

from harvester.core.identity import Identity
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table
from harvester.spark.drain.kafka_sink import ACCEPT_OPTION, KafkaPartitionError
from tests.spark_drain.conftest import Drain, deduplicated, preload, remaining, to_kafka
from tests.support.kafka import consumed_headers, delete_topics, read_messages, text
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration


def delivered(messages: list[Message]) -> dict[str, list[int]]:
    """Per key, the outbox ids in the order Kafka holds them (a key is in one partition)."""
    out: dict[str, list[int]] = defaultdict(list)
    for msg in messages:
        identity = Identity.from_headers(consumed_headers(msg))
        assert identity is not None
        out[text(msg.key())].append(identity.id)
    return out


def test_drains_a_preloaded_outbox_per_shard_in_key_order(
    services: Services,
    pg: psycopg.Connection[Any],
    outbox: TableName,
    topics: Callable[..., str],
    drained: Drain,
    tmp_path: Path,
) -> None:
    # Above the sink producer's batch.size (16384): its batches of small records fit.
    topic, group = topics(partitions=4, **{"max.message.bytes": "37000"}), unique("group")
    ids = preload(pg, outbox, topic, 600, keys=40)
    insert = sql.SQL(
        "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values)"
        " VALUES (now(), %s, 'k1', %s, %s, %s) RETURNING id"
    ).format(outbox.ident)

    def row(value: str, hkeys: list[str], hvalues: list[str]) -> int:
        found = pg.execute(insert, (topic, value, hkeys, hvalues)).fetchone()
        assert found is not None
        return int(found[0])

    poison = row("poison", ["a", "b"], ["1"])  # header arrays of different lengths: no message can be made of it
    # Sizes are in bytes: the value column holds 10,000 characters, of 4 bytes each here.
    too_large = row("\U0001f600" * 10_000, [], [])  # Kafka would refuse it for the topic's max.message.bytes
    ids.append(row("\U0001f601" * 9_000, [], []))  # close to the limit, but taken

    stream = drained(
        shards="2", maxRecordsPerTrigger="200", leaderGroupID=group, **{"kafka.bootstrap.servers": services.bootstrap}
    )
    try:
        query = to_kafka(stream, services, tmp_path / "cp")
        query.awaitTermination()
    finally:
        delete_topics(services.bootstrap, [f"{group}.neli"])

    messages = read_messages(services.bootstrap, [topic], len(ids))
    by_key = delivered(messages)
    assert sorted(i for got in by_key.values() for i in got) == ids  # none lost, none twice
    assert all(got == sorted(got) for got in by_key.values())  # per-key order
    assert remaining(pg, outbox) == []
    # Dead-lettered instead of failing the batch on every replay, and the query went on.
    letters = pg.execute(sql.SQL("SELECT id, reason FROM {} ORDER BY id").format(dead_letter_table(outbox).ident))
    assert letters.fetchall() == [(poison, "malformed"), (too_large, "msg_size_too_large")]
    first = messages[0]
    headers = dict(consumed_headers(first) or [])
    assert {"n", "outbox-id", "outbox-epoch", "outbox-producer", "outbox-batch"} <= set(headers)
    assert text(first.value()) == f"v{text(headers['n'])}"
    # One term per shard, each shard's batches spread over several micro-batches.
    fence = pg.execute(f"SELECT shard, shards FROM {outbox.schema}.harvester_fence ORDER BY shard").fetchall()
    assert fence == [(0, 2), (1, 2)]
    assert len(query.recentProgress) > 600 // 200


def test_a_failed_batch_is_never_purged_and_a_restart_replays_only_it(
    services: Services,
    pg: psycopg.Connection[Any],
    outbox: TableName,
    topics: Callable[..., str],
    drained: Drain,
    tmp_path: Path,
) -> None:
    topic = topics(partitions=2)
    ids = preload(pg, outbox, topic, 1000, keys=20)
    checkpoint = tmp_path / "cp"

    def deliver(fail_at: int | None) -> Callable[[DataFrame, int], None]:
        def write(batch: DataFrame, batch_id: int) -> None:
            (
                batch.selectExpr("topic", "key", "value", "headers")
                .write.format("kafka")
                .option("kafka.bootstrap.servers", services.bootstrap)
                .save()
            )
            if batch_id == fail_at:  # delivered, but the batch fails before Spark commits it
                raise RuntimeError("injected failure after delivery")

        return write

    def run(fail_at: int | None) -> StreamingQuery:
        return (
            drained(maxRecordsPerTrigger="200")
            .writeStream.foreachBatch(deliver(fail_at))
            .option("checkpointLocation", str(checkpoint))
            .trigger(availableNow=True)
            .start()
        )

    with pytest.raises(StreamingQueryException, match="injected failure"):
        run(fail_at=2).awaitTermination()
    assert remaining(pg, outbox) == ids[400:]  # batches 0 and 1 purged, batch 2 kept
    run(fail_at=None).awaitTermination()  # a new driver, from the checkpoint
    assert remaining(pg, outbox) == []

    messages = read_messages(services.bootstrap, [topic], len(ids) + 200)
    by_key = delivered(messages)
    every = [i for got in by_key.values() for i in got]
    assert sorted(set(every)) == ids  # none lost
    assert sorted(every) == sorted(ids + ids[400:600])  # duplicates: batch 2, replayed, only
    for got in by_key.values():
        firsts = list(dict.fromkeys(got))
        assert firsts == sorted(firsts)  # per-key order, across the failure and the restart
        assert [i for i in got if i > ids[599]] == sorted(i for i in got if i > ids[599])
    # 10 records of each key in the replayed batch, beyond the reader's stacks (depth 8): the
    # batch headers let it drop every copy.
    assert sorted(deduplicated(services, topic, partitions=2)) == ids


def test_a_second_copy_of_the_query_fences_the_first(
    services: Services,
    pg: psycopg.Connection[Any],
    outbox: TableName,
    topics: Callable[..., str],
    drained: Drain,
    tmp_path: Path,
) -> None:
    topic = topics()
    ids = preload(pg, outbox, topic, 600, keys=10)
    first = (
        drained(maxRecordsPerTrigger="50")
        .selectExpr("topic", "key", "value", "headers", "partition")
        .writeStream.format("kafka")
        .option("kafka.bootstrap.servers", services.bootstrap)
        .option("checkpointLocation", str(tmp_path / "first"))
        .trigger(processingTime="1 second")
        .start()
    )
    try:
        while len(remaining(pg, outbox)) == len(ids) and first.isActive:
            first.awaitTermination(1)  # until the first copy purged a batch
        # The rest in a few batches: the first copy only has to plan once more after it.
        second = to_kafka(drained(maxRecordsPerTrigger="300"), services, tmp_path / "second")
        second.awaitTermination()
        # The first copy's next plan or purge finds its epoch superseded, and the query stops.
        with pytest.raises(StreamingQueryException, match="fenced"):
            first.awaitTermination()
    finally:
        first.stop()
    assert remaining(pg, outbox) == []
    messages = read_messages(services.bootstrap, [topic], len(ids))
    by_key = delivered(messages)
    assert sorted(set(i for got in by_key.values() for i in got)) == ids


def test_spark_kafka_sink_without_the_partition_column_is_refused_unless_acknowledged(
    services: Services, drained: Drain, tmp_path: Path
) -> None:
    writer = (
        drained()
        .selectExpr("topic", "key", "value", "headers")
        .writeStream.format("kafka")
        .option("kafka.bootstrap.servers", services.bootstrap)
        .option("checkpointLocation", str(tmp_path / "cp"))
    )
    with pytest.raises(KafkaPartitionError, match="without its 'partition' column") as refused:
        writer.start()
    assert "\n" not in str(refused.value)  # one line
    query = writer.option(ACCEPT_OPTION, "true").start()  # Spark's placement, knowingly
    query.stop()

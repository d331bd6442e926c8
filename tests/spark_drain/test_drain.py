"""Draining an outbox with Spark micro-batches into Kafka through Spark's own Kafka sink."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Message

from harvester.core.identity import Identity
from harvester.postgres.identifiers import TableName
from tests.spark_drain.conftest import Drain, preload, remaining, to_kafka
from tests.support import Services, consumed_headers, read_messages, text

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
    topic = topics(partitions=4)
    ids = preload(pg, outbox, topic, 2000, keys=40)

    query = to_kafka(drained(shards="2", maxRecordsPerTrigger="300"), services, tmp_path / "cp")
    query.awaitTermination()

    messages = read_messages(services.bootstrap, [topic], len(ids))
    by_key = delivered(messages)
    assert sorted(i for got in by_key.values() for i in got) == ids  # none lost, none twice
    assert all(got == sorted(got) for got in by_key.values())  # per-key order
    assert remaining(pg, outbox) == []
    first = messages[0]
    headers = dict(consumed_headers(first) or [])
    assert set(headers) == {"n", "outbox-id", "outbox-epoch", "outbox-producer"}
    assert text(first.value()) == f"v{text(headers['n'])}"
    # One term per shard, each shard's batches spread over several micro-batches.
    fence = pg.execute(f"SELECT shard, shards FROM {outbox.schema}.harvester_fence ORDER BY shard").fetchall()
    assert fence == [(0, 2), (1, 2)]
    assert len(query.recentProgress) > 2000 // 300

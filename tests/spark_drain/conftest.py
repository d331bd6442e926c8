"""A local SparkSession with Spark's Kafka connector and the ``outbox`` data source, and the helpers
the drain tests share: a preloaded outbox, and a query that drains it into Kafka."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import TopicPartition
from psycopg import sql
from pyspark.sql import DataFrame, SparkSession

from harvester.client.dedup import DedupReader
from harvester.core.identity import Identity
from harvester.postgres.schema.identifiers import TableName
from tests.dedup.kafka import consumer, ends, read_to
from tests.spark.cluster import local_session
from tests.support.kafka import consumed_headers
from tests.support.services import Services


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """:func:`local_session`."""
    session = local_session("harvester-drain-tests")
    yield session
    session.stop()


def preload(conn: psycopg.Connection[Any], table: TableName, topic: str, count: int, keys: int) -> list[int]:
    """Insert ``count`` records over ``keys`` keys (record n has key ``k<n % keys>``, value ``v<n>``
    and one header ``n``); return their ids."""
    rows = conn.execute(
        sql.SQL(
            "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values)"
            " SELECT now(), %s, 'k' || (n %% %s), 'v' || n, ARRAY['n'], ARRAY[n::text]"
            " FROM generate_series(1, %s) AS n ORDER BY n RETURNING id"
        ).format(table.ident),
        (topic, keys, count),
    ).fetchall()
    return sorted(int(r[0]) for r in rows)


def preload_a_third_missing(
    conn: psycopg.Connection[Any], table: TableName, good: str, missing: str, count: int
) -> list[int]:
    """Insert ``count`` records over 30 keys (record n has key ``k<n % 30>``, value ``v<n>``), those
    whose n is a multiple of 3 (every record of keys k0, k3, ...) to ``missing``, the rest to
    ``good``; return the ids of those sent to ``missing``."""
    rows = conn.execute(
        sql.SQL(
            "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values)"
            " SELECT now(), CASE WHEN n %% 3 = 0 THEN %s ELSE %s END, 'k' || (n %% 30), 'v' || n, '{{}}', '{{}}'"
            " FROM generate_series(1, %s) AS n ORDER BY n RETURNING id, kafka_topic"
        ).format(table.ident),
        (missing, good, count),
    ).fetchall()
    return sorted(int(r[0]) for r in rows if r[1] == missing)


def remaining(conn: psycopg.Connection[Any], table: TableName) -> list[int]:
    """The ids still in the outbox."""
    return [int(r[0]) for r in conn.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(table.ident))]


Drain = Callable[..., DataFrame]


@pytest.fixture
def drained(spark: SparkSession, services: Services, outbox: TableName) -> Drain:
    """The ``outbox`` streaming source over this test's outbox; keyword arguments are more options."""

    def make(**options: str) -> DataFrame:
        return (
            spark.readStream.format("outbox")
            .option("dsn", services.pg_dsn)
            .option("table", outbox.qualified)
            .options(**options)
            .load()
        )

    return make


def to_kafka(stream: DataFrame, services: Services, checkpoint: Path) -> Any:
    """Start delivering ``stream`` through Spark's Kafka sink until the outbox is drained, each record
    to the partition the drain names (a reaper's; null, Spark's choice, when the source was given no
    brokers)."""
    return (
        stream.selectExpr("topic", "key", "value", "headers", "partition")
        .writeStream.format("kafka")
        .option("kafka.bootstrap.servers", services.bootstrap)
        .option("checkpointLocation", str(checkpoint))
        .trigger(availableNow=True)
        .start()
    )


def deduplicated(services: Services, topic: str, partitions: int) -> list[int]:
    """The outbox ids that :class:`DedupReader` yields from the whole of ``topic``, in the order read."""
    with consumer(services) as c:
        reader = DedupReader(c)
        end = ends(c, topic, partitions)
        reader.assign([TopicPartition(topic, p, 0) for p in range(partitions)])
        out = []
        for msg in read_to(reader, end):
            identity = Identity.from_headers(consumed_headers(msg))
            assert identity is not None
            out.append(identity.id)
        return out

"""The services the suite relies on are real and reachable."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from confluent_kafka import Producer

from harvester.postgres.schema.identifiers import TableName
from tests.support.kafka import read_messages
from tests.support.services import Services

pytestmark = pytest.mark.integration


def test_postgres_runs_queries(pg: psycopg.Connection[tuple[object, ...]], outbox: TableName) -> None:
    row = pg.execute("SELECT current_setting('server_version_num')::int").fetchone()
    assert row is not None and int(str(row[0])) >= 150000
    cols = pg.execute(
        "SELECT column_name FROM information_schema.columns WHERE table_schema = %s AND table_name = %s"
        " ORDER BY ordinal_position",
        (outbox.schema, outbox.name),
    ).fetchall()
    assert [c[0] for c in cols][:8] == [  # goharvest's layout; optional columns follow
        "id",
        "create_time",
        "kafka_topic",
        "kafka_key",
        "kafka_value",
        "kafka_header_keys",
        "kafka_header_values",
        "leader_id",
    ]


def test_kafka_round_trip(services: Services, topics: Callable[..., str]) -> None:
    topic = topics()
    producer = Producer(services.kafka())
    for i in range(10):
        producer.produce(topic, key=b"k", value=str(i).encode())
    assert producer.flush(30) == 0
    got = read_messages(services.bootstrap, [topic], 10)
    assert [m.value() for m in got] == [str(i).encode() for i in range(10)]

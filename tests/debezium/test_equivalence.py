"""The reaper with ``layout: debezium`` publishes what Debezium's PostgreSQL connector with its outbox
``EventRouter`` publishes: the same rows (several aggregate types, renamed columns, additional columns
as headers, NULL payloads and header values, rows deleted in the transaction that inserted them, a
transaction rolled back) drained once by Debezium 3.3.2 in Kafka Connect 4.1.1 standalone
(bench/debezium_connect.py, as bench/peers.py runs it; the jars from Maven Central on first use) and
once by the reaper, each into topics of its own, give equal records: topic (but for each relay's
prefix), partition (by key, or a column placed as the partition), key, value, EventRouter's headers
(the reaper's identity headers after them) and timestamp (``table.field.event.timestamp``), in the
same order per key."""

from __future__ import annotations

import sys
import uuid
from collections import defaultdict
from collections.abc import Iterator, Sequence
from pathlib import Path
from typing import Any

import psycopg
import pytest
from confluent_kafka import Message
from psycopg import sql

from harvester import HarvesterConfig
from harvester.postgres.log import logical
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import ensure
from tests.log.conftest import drop_slot as drop_harvester_slot
from tests.log.conftest import logical_dsn  # noqa: F401 (the fixture)
from tests.support.harvesters import harvesters
from tests.support.kafka import consumed_headers, create_topics, delete_topics, read_messages
from tests.support.names import unique
from tests.support.paths import ROOT
from tests.support.ports import free_ports
from tests.support.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# Kafka Connect as bench/peers.py runs it (bench/ holds its modules at its top).
sys.path.append(str(ROOT / "bench"))  # after the standard library: a bench module must not shadow one
from debezium_connect import ConnectWorker, connector_config, resolve_jars, streaming_connector  # noqa: E402

PARTITIONS = 4
AGGREGATES = ("Order", "Customer", "Invoice")
# Renamed columns: EventRouter's defaults are id, aggregateid, aggregatetype, payload.
DDL = """CREATE TABLE {} (
  event_id UUID PRIMARY KEY,
  aggregate_type VARCHAR(255) NOT NULL,
  aggregate_id VARCHAR(255) NOT NULL,
  event_type VARCHAR(255) NOT NULL,
  tenant TEXT,
  shard INTEGER,
  payload JSONB,
  created_at TIMESTAMP NOT NULL DEFAULT now()
)"""


def event_router(replacement: str) -> dict[str, str]:
    return {
        "table.field.event.id": "event_id",
        "table.field.event.key": "aggregate_id",
        "table.field.event.payload": "payload",
        "route.by.field": "aggregate_type",
        "route.topic.replacement": replacement,
        "table.fields.additional.placement": "event_type:header:eventType,tenant:header,shard:partition",
        "table.field.event.timestamp": "created_at",
    }


@pytest.fixture(scope="module")
def connect(tmp_path_factory: pytest.TempPathFactory, services: Services) -> Iterator[ConnectWorker]:
    resolve_jars()
    state = Path(tmp_path_factory.mktemp("connect"))
    worker = ConnectWorker(state, bootstrap=services.bootstrap, port=free_ports(1))
    try:
        worker.start()  # a start that fails stops the JVM too
        yield worker
    finally:
        worker.stop()


# aggregate type, key, event type, tenant, shard (the partition placed), payload
Row = tuple[str, str, str, str | None, int | None, str | None]


def write(conn: psycopg.Connection[Any], table: TableName) -> int:
    """The transactions of the test, committed or not; the number of rows committed."""
    columns = "event_id, aggregate_type, aggregate_id, event_type, tenant, shard, payload"
    insert = sql.SQL("INSERT INTO {} (" + columns + ") VALUES (%s, %s, %s, %s, %s, %s, %s)").format(table.ident)

    def txn(rows: Sequence[Row], *, delete: bool = False, commit: bool = True) -> int:
        with conn.transaction(force_rollback=not commit), conn.cursor() as cur:
            ids = [uuid.uuid4() for _ in rows]
            cur.executemany(insert, [(i, *row) for i, row in zip(ids, rows, strict=True)])
            if delete:  # the framework extensions' pattern: the row lives only in the log
                cur.execute(sql.SQL("DELETE FROM {} WHERE event_id = ANY(%s)").format(table.ident), (ids,))
        return len(rows) if commit else 0

    def payload(i: int) -> str:
        return f'{{"n": {i}, "items": [1, 2], "note": "caf\\u00e9 {i}"}}'

    def shard(i: int) -> int | None:  # a partition of the row's own for some, the key's for the others
        return (i * 3) % PARTITIONS if i % 2 else None

    committed = txn([(AGGREGATES[i % 3], f"k{i % 4}", "Created", "acme", shard(i), payload(i)) for i in range(6)])
    committed += txn(
        [(AGGREGATES[i % 3], f"k{i % 5}", "Updated", "acme", shard(i), payload(i)) for i in range(5)], delete=True
    )
    committed += txn([("Order", "k1", "Deleted", None, None, None), ("Customer", "k9", "Deleted", "", 2, None)])
    committed += txn([("Order", "k1", "Lost", "acme", None, payload(99))] * 3, commit=False)  # rolled back
    runs = [(AGGREGATES[i % 3], f"k{i % 3}", "Seq", "acme", None, payload(100 + i)) for i in range(30)]
    committed += txn(runs, delete=True)  # a run of each key, for their order
    return committed


# topic, partition, value, headers, (timestamp type, timestamp)
Compared = tuple[str, int, bytes | None, list[tuple[str, bytes | None]], tuple[int, int]]


def by_key(messages: list[Message], prefix: str, identity: bool) -> dict[bytes | None, list[Compared]]:
    """Each key's records in their order (a partition's, then the next's: a placed partition takes a
    record from its key's), the relay's topic prefix cut."""
    out: dict[bytes | None, list[Compared]] = defaultdict(list)
    for m in sorted(messages, key=lambda m: (m.topic(), m.partition(), m.offset())):
        topic = str(m.topic())
        assert topic.startswith(prefix)
        headers = list(consumed_headers(m) or [])
        names = [h[0] for h in headers]
        if identity:  # EventRouter's, then the reaper's identity headers
            assert names[-3:] == ["outbox-id", "outbox-epoch", "outbox-producer"], names
            headers = headers[:-3]
        out[m.key()].append((topic[len(prefix) :], int(m.partition() or 0), m.value(), headers, m.timestamp()))
    return out


def test_the_reaper_publishes_what_debeziums_event_router_publishes(
    services: Services,
    logical_dsn: str,  # noqa: F811 (the fixture)
    connect: ConnectWorker,
) -> None:
    schema = unique("dbz")
    table = TableName(schema, "outboxevent")
    dbz, rpr = f"{schema}.dbz.", f"{schema}.rpr."
    topics = [p + a for p in (dbz, rpr) for a in AGGREGATES]
    create_topics(services.bootstrap, topics, PARTITIONS)
    harvest = HarvesterConfig.model_validate(
        {
            "dataSource": logical_dsn,
            "outboxTable": table.qualified,
            "source": "log",
            "layout": "debezium",
            "eventRouter": event_router(rpr + "${routedByValue}"),
            "baseKafkaConfig": {"bootstrap.servers": services.bootstrap},
            "limits": {"ioErrorBackoff": "100ms"},
        }
    )
    setup = harvest.log_setup
    name = f"{schema}_dbz"
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        try:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            conn.execute(sql.SQL(DDL).format(table.ident))
            # reaper migrate's work for this layout: fence and dead-letter tables, publication, slot.
            ensure(conn, table, "fence")
            ensure(conn, table, "dead_letter", value_type="BYTEA")
            logical.create(conn, setup)
            config = {
                **connector_config(name, logical_dsn, table, event_router(dbz + "${routedByValue}")),
                "extended.headers.enabled": "false",  # the connector's __debezium.context.* headers: not EventRouter's
            }
            with streaming_connector(conn, connect, name, config):
                committed = write(conn, table)
                debezium = read_messages(services.bootstrap, topics[:3], committed, timeout=120)
            with harvesters(lambda: harvest) as make:
                make()
                reaper = read_messages(services.bootstrap, topics[3:], committed, timeout=120)
            # Rows deleted as they were inserted are gone; the rows that stayed are left, as
            # Debezium leaves them (no retention window).
            assert conn.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone() == (8,)
        finally:
            drop_harvester_slot(conn, setup.slot)
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(setup.publication)))
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            delete_topics(services.bootstrap, topics)
    assert committed == 43
    assert len(debezium) == len(reaper) == committed
    expected = by_key(debezium, dbz, identity=False)
    assert by_key(reaper, rpr, identity=True) == expected
    # The comparison covers what it is meant to: keys spread over partitions, a NULL payload and header.
    assert len({p for records in expected.values() for _, p, *_ in records}) > 1
    assert any(v is None for records in expected.values() for _, _, v, *_ in records)
    assert any(h == ("tenant", None) for records in expected.values() for *_, hs, _ in records for h in hs)
    # A record on a partition of its own, beside its key's (the timestamps are the rows', as they are
    # equal: a relay's own would differ).
    assert any(len({p for _, p, *_ in records}) > 1 for records in expected.values())

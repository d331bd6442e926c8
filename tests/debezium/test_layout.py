"""A table of Debezium's outbox layout, set up by ``reaper migrate``, drained by the log source in
both delivery modes: rows deleted in the transaction that inserted them are published and nothing
is deleted for them; rows that stay are deleted in bulk by the retention window (at least once) or
left (exactly once, no window); a bytea payload goes out as its bytes; a row with a NULL key is a
dead letter (which ``reaper dlq replay`` refuses to write back as a row) and its key's other rows go
on. With ``table.field.event.timestamp`` and a ``partition`` placement, each record's Kafka timestamp
and partition are those columns' (each publisher), a NULL leaving them to the producer, a negative
partition or one the topic lacks a dead letter."""

from __future__ import annotations

import json
import time
from datetime import UTC, datetime
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import TIMESTAMP_CREATE_TIME
from psycopg import sql

from harvester import HarvesterConfig
from harvester.postgres.log import logical
from harvester.postgres.schema.migrations import dead_letter_table, ensure
from tests.engine.workload import wait_until
from tests.log.conftest import (
    drop_slot,
    logical_dsn,  # noqa: F401 (the fixture)
)
from tests.log.test_log_source import COMMITTED, DELIVERY
from tests.support.harvesters import harvesters
from tests.support.kafka import consumed_headers, create_topics, delete_topics, read_messages
from tests.support.names import unique
from tests.support.reaper import run_reaper
from tests.support.services import Services

pytestmark = pytest.mark.integration

TRACEPARENT = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
TRACED = f"#Sat Nov 28 04:00:00 UTC 2026\ntraceparent={TRACEPARENT}\n"


@DELIVERY
def test_insert_then_delete_and_rows_that_stay(
    services: Services,
    logical_dsn: str,  # noqa: F811 (the fixture)
    tmp_path: Path,
    delivery: str,
) -> None:
    schema = unique("dbz")
    table = f"{schema}.outboxevent"
    payload = "BYTEA" if delivery == "at_least_once" else "VARCHAR(8000)"
    harvest = {
        "dataSource": logical_dsn,
        "outboxTable": table,
        "source": "log",
        "layout": "debezium",
        "delivery": delivery,
        "eventRouter": {"route.topic.replacement": schema + ".${routedByValue}"},
        "baseKafkaConfig": {"bootstrap.servers": services.bootstrap},
        "limits": {"ioErrorBackoff": "100ms"},
        **({"logRetention": "1s"} if delivery == "at_least_once" else {}),
    }
    (tmp_path / "reaper.yaml").write_text(json.dumps({"harvest": harvest}))  # YAML reads JSON
    config = HarvesterConfig.model_validate(harvest)

    def as_payload(text: str) -> str | bytes:
        return text.encode() if payload == "BYTEA" else text

    create_topics(services.bootstrap, [f"{schema}.Order"], 3)
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        try:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            columns = (
                "id UUID PRIMARY KEY DEFAULT gen_random_uuid(), aggregatetype VARCHAR(255) NOT NULL,"
                f" aggregateid VARCHAR(255), type VARCHAR(255) NOT NULL, payload {payload}, tracingspancontext TEXT"
            )
            conn.execute(sql.SQL("CREATE TABLE {} (" + columns + ")").format(config.table.ident))
            migrated = run_reaper("migrate", "-f", str(tmp_path / "reaper.yaml"))
            assert migrated.returncode == 0, migrated.stderr
            assert "outbox table (layout debezium)" in migrated.stdout, migrated.stdout
            insert = sql.SQL(
                "INSERT INTO {} (aggregatetype, aggregateid, type, payload, tracingspancontext)"
                " VALUES (%s, %s, 'T', %s, %s)"
            ).format(config.table.ident)
            with harvesters(lambda: config) as make:
                make()
                with conn.transaction(), conn.cursor() as cur:  # insert-then-delete
                    cur.executemany(insert, [("Order", f"k{i % 3}", as_payload(f"d{i}"), None) for i in range(9)])
                    cur.execute(sql.SQL("DELETE FROM {}").format(config.table.ident))
                with conn.transaction(), conn.cursor() as cur:  # rows that stay, one with a NULL key
                    stay = [("Order", f"k{i % 3}", as_payload(f"s{i}"), TRACED if i == 0 else None) for i in range(6)]
                    cur.executemany(insert, stay)
                    cur.execute(insert, ("Order", None, as_payload("no key"), None))
                messages = read_messages(services.bootstrap, [f"{schema}.Order"], 15, **COMMITTED)
                # At least once, the dead letter's failures remark (a new pass): a key's run may come again
                # after it, in order; each value's first copy keeps the key's order.
                keys = (b"k0", b"k1", b"k2")
                values = {k: list(dict.fromkeys(m.value() for m in messages if m.key() == k)) for k in keys}
                assert values == {
                    f"k{k}".encode(): [f"{p}{i}".encode() for p in "ds" for i in range(k, 9 if p == "d" else 6, 3)]
                    for k in range(3)
                }
                assert all(next(h[0] for h in consumed_headers(m) or []) == "id" for m in messages)
                # The tracing span context column's trace context, as the record's (Properties text).
                traced = next(m for m in messages if m.value() == b"s0")
                assert ("traceparent", TRACEPARENT.encode()) in (consumed_headers(traced) or [])
                dead = sql.SQL("SELECT kafka_value FROM {}").format(dead_letter_table(config.table).ident)
                assert wait_until(lambda: conn.execute(dead).fetchall() == [(b"no key",)])
                if delivery == "exactly_once":  # once: replay is refused in one line, the dead letter kept
                    replay = run_reaper("dlq", "replay", "--all", "--yes", "-f", str(tmp_path / "reaper.yaml"))
                    assert replay.returncode == 2 and "cannot be written back as a row" in replay.stderr
                    assert len(replay.stderr.splitlines()) == 1, replay.stderr
                    assert conn.execute(dead).fetchall() == [(b"no key",)]
                left = sql.SQL("SELECT count(*) FROM {}").format(config.table.ident)
                if delivery == "at_least_once":  # the window deletes the rows that stayed, the dead letter's too
                    assert wait_until(lambda: conn.execute(left).fetchone() == (0,), timeout=60)
                else:
                    assert conn.execute(left).fetchone() == (7,)
        finally:
            drop_slot(conn, config.slot)
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(config.publication)))
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            delete_topics(services.bootstrap, [f"{schema}.Order"])


# Each publisher that gives records their timestamps: the producer process's, the in-process one's,
# the transactional one's.
PUBLISHERS = pytest.mark.parametrize(
    "delivery,in_child", [("at_least_once", True), ("at_least_once", False), ("exactly_once", True)]
)


@PUBLISHERS
def test_timestamp_and_partition_columns_place_the_records(
    services: Services,
    logical_dsn: str,  # noqa: F811 (the fixture)
    delivery: str,
    in_child: bool,
) -> None:
    schema = unique("dbzts")
    config = HarvesterConfig.model_validate(
        {
            "dataSource": logical_dsn,
            "outboxTable": f"{schema}.outboxevent",
            "source": "log",
            "layout": "debezium",
            "delivery": delivery,
            "producerProcess": in_child,
            "eventRouter": {
                "route.topic.replacement": schema,
                "table.field.event.timestamp": "occurred",
                "table.fields.additional.placement": "shard:partition",
            },
            "baseKafkaConfig": {"bootstrap.servers": services.bootstrap},
        }
    )
    times = [datetime(2026, 11, 28, 4, 0, 0, 123456 + i, tzinfo=UTC) for i in range(3)]
    before = int(time.time() * 1000)
    create_topics(services.bootstrap, [schema], 3)
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        try:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            columns = (
                "id UUID PRIMARY KEY, aggregatetype TEXT, aggregateid TEXT, payload TEXT, occurred TIMESTAMP, shard INT"
            )
            conn.execute(sql.SQL("CREATE TABLE {} (" + columns + ")").format(config.table.ident))
            ensure(conn, config.table, "fence")
            ensure(conn, config.table, "dead_letter", value_type="BYTEA")
            logical.create(conn, config.log_setup)
            insert = sql.SQL(
                "INSERT INTO {} VALUES (gen_random_uuid(), 'Order', 'k', %s, %s::timestamptz AT TIME ZONE 'UTC', %s)"
            ).format(config.table.ident)
            rows = [*((f"v{i}", t, 2 - i) for i, t in enumerate(times)), ("none", None, None), ("neg", times[0], -1)]
            rows.append(("far", times[0], 3))  # a partition the topic lacks: Kafka refuses it for good
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(insert, rows)
            with harvesters(lambda: config) as make:
                make()
                messages = read_messages(services.bootstrap, [schema], 4, **COMMITTED)
                dead = sql.SQL("SELECT kafka_value FROM {} ORDER BY 1").format(dead_letter_table(config.table).ident)
                assert wait_until(lambda: conn.execute(dead).fetchall() == [(b"far",), (b"neg",)])
        finally:
            drop_slot(conn, config.slot)
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(config.publication)))
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            delete_topics(services.bootstrap, [schema])
    stamps = {m.value(): m.timestamp() for m in messages}
    # The column's time in milliseconds, its microseconds cut (EventRouter's MicroTimestamp / 1000).
    expected = int(times[0].timestamp()) * 1000 + 123
    assert [stamps[f"v{i}".encode()] for i in range(3)] == [(TIMESTAMP_CREATE_TIME, expected)] * 3
    kind, produced = stamps[b"none"]  # a NULL: the producer's clock, as without the option
    assert kind == TIMESTAMP_CREATE_TIME and produced >= before
    partitions = {m.value(): m.partition() for m in messages}
    assert [partitions[f"v{i}".encode()] for i in range(3)] == [2, 1, 0]  # each on the column's

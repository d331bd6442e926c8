"""The log source decodes real inserts (pgoutput's binary forms) into the records the mark-purge
store reads from the same rows: every value type, headers with quotes and NULLs, NULL values,
malformed rows, and a layout other than the usual one; the usual layout's fast paths (C and Python)
and the general one agree on every row, and a column type the log source cannot read is reported with the fix."""

from __future__ import annotations

import dataclasses
from collections.abc import Iterator
from datetime import UTC, datetime
from typing import Any, LiteralString
from uuid import uuid4

import psycopg
import pytest
from psycopg import sql

from harvester import HarvesterConfig
from harvester.compose import log_store
from harvester.core.protocols import StoreError
from harvester.core.records import MarkedRecord
from harvester.postgres.log import logical, pgoutput
from harvester.postgres.log.records import READABLE_TYPES, Columns, outbox_record
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import migrate
from harvester.postgres.table.store import PostgresStore
from tests.log.conftest import drop_slot
from tests.log.test_log_source import mark_all
from tests.support.names import unique

pytestmark = pytest.mark.integration

# Neither id order nor the usual types: integer id, timestamp without time zone, text, varchar[],
# nullable key and header arrays, the columns in another order.
OTHER_LAYOUT = """CREATE TABLE {} (
  kafka_key TEXT, id SERIAL PRIMARY KEY, kafka_value TEXT, kafka_topic TEXT NOT NULL,
  create_time TIMESTAMP NOT NULL DEFAULT now(), kafka_header_values VARCHAR[] DEFAULT '{{}}',
  kafka_header_keys VARCHAR[] DEFAULT '{{}}', leader_id UUID)"""

UUID_KEY = """CREATE TABLE {} (
  id BIGSERIAL PRIMARY KEY, create_time TIMESTAMPTZ NOT NULL DEFAULT now(), kafka_topic VARCHAR(249) NOT NULL,
  kafka_key UUID NOT NULL, kafka_value VARCHAR(10000), kafka_header_keys TEXT[] NOT NULL DEFAULT '{{}}',
  kafka_header_values TEXT[] NOT NULL DEFAULT '{{}}', leader_id UUID)"""

# (key, value, header keys, header values); the value's SQL type decides how it is stored.
ROWS: list[tuple[str | None, Any, list[str | None] | None, list[str | None] | None]] = [
    ("k1", "plain ü", [], []),
    ("k2", None, [], []),
    ("", "v", ["h", 'q"u,o\\te'], ["1", None]),
    ("k3", "v", ["a"], []),  # malformed: one header key, no value
    ("k4", "v", [None], ["x"]),  # malformed: a NULL header key
]
NULLS: list[tuple[str | None, Any, list[str | None] | None, list[str | None] | None]] = [
    (None, "v", [], []),
    ("k5", "v", None, []),
]  # malformed, where the table allows them


@dataclasses.dataclass
class Outbox:
    table: TableName
    setup: logical.LogSetup


@pytest.fixture
def outbox(logical_dsn: str) -> Iterator[Outbox]:
    schema = unique("t")
    table = TableName(schema, "outbox")
    config = HarvesterConfig(outbox_table=table.qualified)
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    yield Outbox(table, logical.LogSetup(table, config.slot, config.publication))
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        drop_slot(conn, config.slot)
        conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(config.publication)))
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def _write(
    dsn: str, outbox: Outbox, ddl: LiteralString | None, value_type: LiteralString | None, rows: list[Any]
) -> None:
    with psycopg.connect(dsn, autocommit=True) as conn:
        if ddl is not None:
            conn.execute(sql.SQL(ddl).format(outbox.table.ident))
        migrate(conn, outbox.table)
        if value_type is not None:
            conn.execute(
                sql.SQL("ALTER TABLE {} ALTER COLUMN kafka_value TYPE {} USING kafka_value::{}").format(
                    outbox.table.ident, sql.SQL(value_type), sql.SQL(value_type)
                )
            )
        logical.create(conn, outbox.setup)
        with conn.transaction():
            for key, value, hkeys, hvalues in rows:
                conn.execute(
                    sql.SQL(
                        "INSERT INTO {} (kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values)"
                        " VALUES ('t', %s, %s, %s, %s)"
                    ).format(outbox.table.ident),
                    (key, value, hkeys, hvalues),
                )


def _peeked(dsn: str, outbox: Outbox) -> tuple[pgoutput.Relation, list[bytes]]:
    """The outbox's Relation and Insert messages in the slot, read without consuming them."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        rows = conn.execute(
            "SELECT data FROM pg_logical_slot_peek_binary_changes(%s, NULL, NULL, 'proto_version', '1',"
            " 'publication_names', %s, 'binary', 'true')",
            (outbox.setup.slot, outbox.setup.publication),
        ).fetchall()
    messages = [bytes(r[0]) for r in rows]
    relation = next(m for m in map(pgoutput.parse, messages) if isinstance(m, pgoutput.Relation))
    return relation, [m for m in messages if m[:1] == b"I"]


def _streamed(dsn: str, outbox: Outbox, count: int) -> list[MarkedRecord]:
    store = log_store(dsn, outbox.setup)
    try:
        store.prepare()
        leader = uuid4()
        store.acquire(leader)
        return mark_all(store, leader, count)
    finally:
        store.close()


def _selected(dsn: str, outbox: Outbox) -> list[MarkedRecord]:
    """What the mark-purge store makes of the same rows."""
    store = PostgresStore(dsn, outbox.table)
    try:
        store.prepare()
        leader = uuid4()
        store.acquire(leader)
        return store.mark(leader, 100)
    finally:
        store.close()


def _fields(record: MarkedRecord) -> tuple[Any, ...]:
    when = record.create_time
    aware = when if when.tzinfo is not None else when.replace(tzinfo=UTC)  # a timestamp without time zone
    headers = record.headers if record.malformed is None else None  # a malformed row's go nowhere
    return record.id, aware, record.topic, record.key, record.value, headers, record.malformed


def _check(dsn: str, outbox: Outbox, rows: list[Any], *, usual: bool) -> list[MarkedRecord]:
    relation, inserts = _peeked(dsn, outbox)
    columns, general = Columns(relation), Columns(relation)
    assert columns.usual is usual
    assert (columns.native is not None) is usual, "the native decoder was not built: see ./dev.sh, .local/native.log"
    with pytest.MonkeyPatch.context() as env:
        env.setenv("HARVESTER_INSERT_DECODER", "python")
        python = Columns(relation)
    general.usual = False
    decoded = [outbox_record(data, columns) for data in inserts]
    # The usual rows' C decoder, their Python one and the general path: one record.
    assert decoded == [outbox_record(data, python) for data in inserts]
    assert decoded == [outbox_record(data, general) for data in inserts]
    streamed = _streamed(dsn, outbox, len(rows))
    assert [dataclasses.replace(r, stamp=None) for r in streamed] == decoded
    assert [_fields(r) for r in decoded] == [_fields(r) for r in _selected(dsn, outbox)]
    return decoded


@pytest.mark.parametrize("value_type", [None, "text", "jsonb", "bytea"])
def test_the_usual_layout_decodes_as_the_mark_purge_store_reads(
    logical_dsn: str, outbox: Outbox, value_type: LiteralString | None
) -> None:
    rows = list(ROWS)
    if value_type == "bytea":
        rows = [(k, v.encode() if v else v, hk, hv) for k, v, hk, hv in rows] + [("k6", bytes(range(256)), [], [])]
    if value_type == "jsonb":
        rows = [(k, None if v is None else f'{{"s": "{v}", "n": [1, 2]}}', hk, hv) for k, v, hk, hv in rows]
    _write(logical_dsn, outbox, None, value_type, rows)
    decoded = _check(logical_dsn, outbox, rows, usual=True)
    assert [r.malformed is not None for r in decoded[:5]] == [False, False, False, True, True]
    assert decoded[2].headers == [("h", b"1"), ('q"u,o\\te', b"")]  # a NULL header value is sent empty
    assert decoded[1].value is None and decoded[0].create_time.tzinfo is not None


def test_another_layout_decodes_column_by_column_as_the_mark_purge_store_reads(
    logical_dsn: str, outbox: Outbox
) -> None:
    rows = ROWS + NULLS
    _write(logical_dsn, outbox, OTHER_LAYOUT, None, rows)
    decoded = _check(logical_dsn, outbox, rows, usual=False)
    assert [r.malformed for r in decoded[-2:]] == ["kafka_key is NULL", "header arrays are NULL"]
    assert abs(decoded[0].create_time - datetime.now(UTC)).total_seconds() < 60  # read as UTC


def test_a_two_dimensional_header_array_is_malformed(logical_dsn: str, outbox: Outbox) -> None:
    _write(logical_dsn, outbox, None, None, [("k", "v", [["a", "b"]], [["1", "2"]])])
    relation, inserts = _peeked(logical_dsn, outbox)
    record = outbox_record(inserts[0], Columns(relation))
    assert record.malformed == "header arrays have more than one dimension" and record.headers == []


def test_a_column_type_it_cannot_read_is_reported_with_the_fix(logical_dsn: str, outbox: Outbox) -> None:
    _write(logical_dsn, outbox, UUID_KEY, None, [])
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        problems = logical.missing(conn, outbox.setup)
        conn.execute(
            sql.SQL("INSERT INTO {} (kafka_topic, kafka_key) VALUES ('t', gen_random_uuid())").format(
                outbox.table.ident
            )
        )
    assert problems == [
        f"the log source cannot read kafka_key of type uuid: it reads {READABLE_TYPES} (ALTER TABLE ... ALTER COLUMN)"
    ]
    relation, _ = _peeked(logical_dsn, outbox)
    with pytest.raises(StoreError, match="cannot read kafka_key of type oid 2950"):
        Columns(relation)

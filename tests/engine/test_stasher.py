"""Applications write the outbox in their own transaction: psycopg and SQLAlchemy helpers."""

from __future__ import annotations

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from harvester import OutboxRecord, RecordError, Stasher, stash
from harvester.postgres.schema.identifiers import TableName
from tests.support.services import Services

pytestmark = pytest.mark.integration


def rows(services: Services, table: TableName) -> list[tuple[object, ...]]:
    with psycopg.connect(services.pg_dsn) as conn:
        return conn.execute(
            sql.SQL(
                "SELECT kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values FROM {} ORDER BY id"
            ).format(table.ident)
        ).fetchall()


def test_psycopg_single_and_bulk_commit_with_the_transaction(services: Services, outbox: TableName) -> None:
    with psycopg.connect(services.pg_dsn) as conn:
        with conn.transaction():
            stash(conn, OutboxRecord.of("t", "k", "one", {"a": "1"}), table=outbox.qualified)
            Stasher(outbox).stash(conn, [OutboxRecord.of("t", f"k{i}", f"v{i}") for i in range(200)])  # COPY path
        with pytest.raises(RuntimeError), conn.transaction():
            stash(conn, OutboxRecord.of("t", "k", "rolled back"), table=outbox.qualified)
            raise RuntimeError("application failure")
    got = rows(services, outbox)
    assert len(got) == 201
    assert got[0] == ("t", "k", "one", ["a"], ["1"])
    assert [r[2] for r in got[1:]] == [f"v{i}" for i in range(200)]


def test_invalid_record_raises_before_touching_the_database(services: Services, outbox: TableName) -> None:
    with psycopg.connect(services.pg_dsn) as conn:
        with pytest.raises(RecordError, match="key has 101"):
            Stasher(outbox).stash(conn, [OutboxRecord.of("t", "ok"), OutboxRecord.of("t", "k" * 101)])
        conn.rollback()
    assert rows(services, outbox) == []


def test_sqlalchemy_session_and_connection(services: Services, outbox: TableName) -> None:
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(services.pg_dsn))
    stasher = Stasher(outbox)
    with Session(engine) as session, session.begin():
        stasher.stash_sqlalchemy(session, [OutboxRecord.of("t", "s", "from-session", [("h", "v")])])
    with engine.begin() as conn:
        stasher.stash_sqlalchemy(conn, OutboxRecord.of("t", "c", "from-connection"))
    engine.dispose()
    assert rows(services, outbox) == [("t", "s", "from-session", ["h"], ["v"]), ("t", "c", "from-connection", [], [])]

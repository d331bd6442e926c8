"""asyncio applications write the outbox in their own transaction: psycopg's AsyncConnection and
SQLAlchemy's AsyncSession/AsyncConnection, on real PostgreSQL (plain tests driving asyncio.run)."""

from __future__ import annotations

import asyncio

import psycopg
import pytest
from psycopg.pq import TransactionStatus
from sqlalchemy.ext.asyncio import AsyncSession, create_async_engine

from harvester import AsyncStasher, ColumnLimits, OutboxMissingError, OutboxRecord, RecordError
from harvester.postgres.schema.identifiers import TableName
from tests.engine.test_stasher import rows
from tests.support.services import Services

pytestmark = pytest.mark.integration


def test_psycopg_async_single_and_bulk_commit_with_the_transaction(services: Services, outbox: TableName) -> None:
    async def write() -> None:
        stasher = AsyncStasher(outbox)
        async with await psycopg.AsyncConnection.connect(services.pg_dsn) as conn:
            async with conn.transaction():
                assert await stasher.stash(conn, OutboxRecord.of("t", "k", "one", {"a": "1"})) == 1
                bulk = [OutboxRecord.of("t", f"k{i}", f"v{i}") for i in range(200)]
                assert await stasher.stash(conn, bulk) == 200  # the COPY path
                assert await stasher.stash(conn, []) == 0
            with pytest.raises(RuntimeError):
                async with conn.transaction():
                    await stasher.stash(conn, [OutboxRecord.of("t", "k", "rolled back")] * 60)
                    raise RuntimeError("application failure")

    asyncio.run(write())
    got = rows(services, outbox)
    assert len(got) == 201
    assert got[0] == ("t", "k", "one", ["a"], ["1"])
    assert [r[2] for r in got[1:]] == [f"v{i}" for i in range(200)]


def test_psycopg_async_never_commits_on_its_own(services: Services, outbox: TableName) -> None:
    async def write() -> None:
        async with await psycopg.AsyncConnection.connect(services.pg_dsn) as conn:
            await AsyncStasher(outbox).stash(conn, OutboxRecord.of("t", "k", "left open"))
            assert conn.info.transaction_status == TransactionStatus.INTRANS
            await conn.rollback()

    asyncio.run(write())
    assert rows(services, outbox) == []


def test_invalid_records_fail_before_any_statement(services: Services, outbox: TableName) -> None:
    bad = [OutboxRecord.of("t", "ok"), OutboxRecord.of("t", "k" * 101)]
    engine = create_async_engine("postgresql+psycopg://", async_creator=lambda: _connect(services))

    async def write() -> None:
        # Limits given up front: no catalog query either, so the connection must stay idle.
        stasher = AsyncStasher(outbox, ColumnLimits())
        async with await psycopg.AsyncConnection.connect(services.pg_dsn) as conn:
            with pytest.raises(RecordError, match="key has 101"):
                await stasher.stash(conn, bad)
            assert conn.info.transaction_status == TransactionStatus.IDLE
        async with AsyncSession(engine) as session:
            with pytest.raises(RecordError, match="key has 101"):
                await stasher.stash_sqlalchemy(session, bad)
            assert not session.in_transaction()
        with pytest.raises(OutboxMissingError):  # the same errors as the synchronous Stasher
            async with await psycopg.AsyncConnection.connect(services.pg_dsn) as conn:
                await AsyncStasher(TableName(outbox.schema, "missing")).stash(conn, bad)
        await engine.dispose()

    asyncio.run(write())
    assert rows(services, outbox) == []


async def _connect(services: Services) -> psycopg.AsyncConnection[tuple[object, ...]]:
    return await psycopg.AsyncConnection.connect(services.pg_dsn)


def test_sqlalchemy_async_session_and_connection(services: Services, outbox: TableName) -> None:
    engine = create_async_engine("postgresql+psycopg://", async_creator=lambda: _connect(services))
    stasher = AsyncStasher(outbox)

    async def write() -> None:
        async with AsyncSession(engine) as session, session.begin():
            await stasher.stash_sqlalchemy(session, [OutboxRecord.of("t", "s", "from-session", [("h", "v")])])
        with pytest.raises(RuntimeError):
            async with AsyncSession(engine) as session, session.begin():
                await stasher.stash_sqlalchemy(session, OutboxRecord.of("t", "s", "rolled back"))
                raise RuntimeError("application failure")
        async with engine.begin() as conn:
            await stasher.stash_sqlalchemy(conn, OutboxRecord.of("t", "c", "from-connection"))
        await engine.dispose()

    asyncio.run(write())
    assert rows(services, outbox) == [("t", "s", "from-session", ["h"], ["v"]), ("t", "c", "from-connection", [], [])]

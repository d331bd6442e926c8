"""Marks stop looking behind the frontier (harvester/postgres/table/frontier.py), and nothing a
transaction commits late, a reset makes eligible again or an application writes with an id of its
own is missed for it: against a real server, with real concurrent transactions."""

from __future__ import annotations

import uuid
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harvester import PostgresStore
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.table import frontier as frontier_module
from harvester.postgres.table.frontier import WRITERS
from harvester.postgres.table.marks import FIRST_ID
from tests.engine.workload import insert
from tests.support.services import Services

pytestmark = pytest.mark.integration

LEADER = uuid.uuid4()


@pytest.fixture
def store(services: Services, outbox: TableName) -> Iterator[PostgresStore]:
    s = PostgresStore.open(services.pg_dsn, outbox)
    s.acquire(LEADER)
    yield s
    s.close()


def rows(services: Services, outbox: TableName, count: int) -> None:
    insert(services.pg_dsn, outbox, [("t", "k", f"v{i}") for i in range(count)])


def drain(store: PostgresStore, limit: int = 50) -> list[int]:
    """Mark until a mark finds nothing, then twice more (the frontier moves a mark or two behind)."""
    ids: list[int] = []
    empty = 0
    while empty < 3:
        got = [r.id for r in store.mark(LEADER, limit)]
        ids += got
        empty = empty + 1 if not got else 0
    return ids


@pytest.fixture
def late() -> Iterator[list[psycopg.Connection[Any]]]:
    """Where a test keeps its open transactions: closed at its end (a failed test left them open)."""
    conns: list[psycopg.Connection[Any]] = []
    yield conns
    for conn in conns:
        conn.close()


def open_writer(
    services: Services, outbox: TableName, late: list[psycopg.Connection[Any]]
) -> tuple[psycopg.Connection[Any], int]:
    """A transaction that inserted one row and has not committed."""
    conn = psycopg.connect(services.pg_dsn)
    late.append(conn)
    row = conn.execute(
        sql.SQL("INSERT INTO {} (kafka_topic, kafka_key, kafka_value) VALUES ('t', 'k', 'late') RETURNING id").format(
            outbox.ident
        )
    ).fetchone()
    assert row is not None
    return conn, int(row[0])


def test_marks_stop_looking_behind_what_they_handed_out(
    services: Services, outbox: TableName, store: PostgresStore
) -> None:
    rows(services, outbox, 300)
    ids = drain(store)
    assert sorted(ids) == ids and len(ids) == 300
    assert store.frontier == ids[-1] + 1
    # Each handed-out id is behind the frontier: a mark's parameters name none of them.
    assert store._handed.exclude(LEADER).ids == []


def test_a_transaction_holding_an_id_keeps_the_frontier_below_it(
    services: Services, outbox: TableName, store: PostgresStore, late: list[psycopg.Connection[Any]]
) -> None:
    writer, late_id = open_writer(services, outbox, late)
    rows(services, outbox, 200)
    first = drain(store)
    assert len(first) == 200 and late_id not in first
    assert store.frontier <= late_id
    writer.commit()
    rows(services, outbox, 100)  # a backlog: its full marks read the writers, and the frontier follows
    after = drain(store)
    assert after[0] == late_id and len(after) == 101
    assert store.frontier > late_id


def test_a_transaction_that_commits_between_a_mark_and_the_read_of_writers_is_found(
    services: Services,
    outbox: TableName,
    store: PostgresStore,
    monkeypatch: pytest.MonkeyPatch,
    late: list[psycopg.Connection[Any]],
) -> None:
    # The mark's snapshot misses the row; by the read of the table's writers its transaction has
    # ended, so the read finds no writer: the next mark must still look behind the ids it saw.
    writer, late_id = open_writer(services, outbox, late)
    rows(services, outbox, 100)
    run = store.db.run

    def commit_first(query: Any, params: Any) -> list[tuple[Any, ...]]:
        if query is WRITERS and writer.info.transaction_status == psycopg.pq.TransactionStatus.INTRANS:
            writer.commit()
        return run(query, params)

    monkeypatch.setattr(store.db, "run", commit_first)
    first = [r.id for r in store.mark(LEADER, 100)]  # a full mark: the writers are read after it
    assert len(first) == 100 and late_id not in first
    assert writer.info.transaction_status == psycopg.pq.TransactionStatus.IDLE
    assert drain(store) == [late_id]


def test_a_reset_behind_the_frontier_is_marked_again(
    services: Services, outbox: TableName, store: PostgresStore
) -> None:
    rows(services, outbox, 150)
    ids = drain(store)
    assert store.frontier == ids[-1] + 1
    store.reset([ids[10], ids[100]])
    assert drain(store) == [ids[10], ids[100]]


def test_a_failure_behind_the_frontier_is_marked_again(
    services: Services, outbox: TableName, store: PostgresStore
) -> None:
    rows(services, outbox, 60)
    ids = drain(store)
    store.reset([ids[0]])
    store.purge(ids[1:])
    assert drain(store) == [ids[0]]


def test_ids_a_sequence_caches_keep_marks_looking_from_the_start(
    services: Services, pg: psycopg.Connection[tuple[object, ...]], outbox: TableName
) -> None:
    pg.execute(sql.SQL("ALTER SEQUENCE {} CACHE 20").format(sql.Identifier(outbox.schema or "", "outbox_id_seq")))
    s = PostgresStore.open(services.pg_dsn, outbox)
    try:
        s.acquire(LEADER)
        rows(services, outbox, 100)
        assert len(drain(s)) == 100
        assert s.frontier == FIRST_ID
    finally:
        s.close()


def test_a_row_written_with_an_id_of_its_own_behind_the_frontier_is_found_by_the_sweep(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    outbox: TableName,
    store: PostgresStore,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    rows(services, outbox, 100)
    ids = drain(store)
    assert store.frontier == ids[-1] + 1
    pg.execute(
        sql.SQL("INSERT INTO {} (id, kafka_topic, kafka_key, kafka_value) VALUES (%s, 't', 'own', 'own')").format(
            outbox.ident
        ),
        (ids[0] - 1,),
    )
    assert drain(store) == []  # behind the frontier: only a sweep looks there
    monkeypatch.setattr(frontier_module, "SWEEP_SECONDS", 0.0)
    store._frontier._sweep_at = 0.0
    assert drain(store) == [ids[0] - 1]

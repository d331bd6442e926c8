"""The leader vacuums the outbox while a backlog drains, so the mark query does not slow down on the
dead rows that purges leave at the head of the table; vacuumEveryRecords=0 leaves it to autovacuum."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import wait_drained, wait_until
from tests.support.harvesters import HarvesterFactory
from tests.support.services import Services

pytestmark = pytest.mark.integration

BACKLOG = 30_000


def vacuums(conn: psycopg.Connection[tuple[object, ...]], table: TableName) -> int:
    row = conn.execute(
        "SELECT vacuum_count FROM pg_stat_user_tables WHERE relid = to_regclass(%s)", (table.quoted,)
    ).fetchone()
    assert row is not None
    return int(str(row[0]))


def preload(conn: psycopg.Connection[tuple[object, ...]], table: TableName, topic: str) -> None:
    conn.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(table.ident))
    copy = sql.SQL("COPY {} (kafka_topic, kafka_key, kafka_value) FROM STDIN").format(table.ident)
    with conn.cursor().copy(copy) as cp:
        for i in range(BACKLOG):
            cp.write_row((topic, f"k{i % 300}", "x" * 50))


@pytest.mark.parametrize("every", [10_000, 0])
def test_the_leader_vacuums_after_every_so_many_purged_records(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    outbox: TableName,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
    every: int,
) -> None:
    preload(pg, outbox, topics())
    make_harvester(vacuum_every_records=every)
    assert wait_drained(services.pg_dsn, outbox) == 0
    if every:
        assert wait_until(lambda: vacuums(pg, outbox) >= 1, timeout=15)
    else:
        assert vacuums(pg, outbox) == 0

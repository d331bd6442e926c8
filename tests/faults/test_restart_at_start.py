"""A database restart as a harvester starts: the connection the store prepares on is terminated
(57P01). The start fails as an unreachable database, which a supervisor retries (the reaper does, a
chaos run's harness starts another process), never as a statement the database refused; the next
start connects again."""

from __future__ import annotations

import psycopg
import pytest

from harvester.core.protocols import StoreUnreachableError
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.table.store import PostgresStore
from tests.support.services import Services


def terminate(dsn: str, pid: int) -> None:
    """End backend ``pid`` as a fast shutdown or ``pg_terminate_backend`` does, waiting for it to go."""
    with psycopg.connect(dsn, autocommit=True) as admin:
        admin.execute("SELECT pg_terminate_backend(%s, 5000)", (pid,))


def test_a_connection_lost_while_preparing_fails_the_start_as_unreachable(
    services: Services, outbox: TableName
) -> None:
    store = PostgresStore(services.pg_dsn, outbox)
    try:
        terminate(services.pg_dsn, store.db.conn().info.backend_pid)
        with pytest.raises(StoreUnreachableError, match="57P01"):
            store.prepare()
        store.prepare()  # on a new connection
        assert store.head() == (0, None)
    finally:
        store.close()

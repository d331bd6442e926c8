"""A PostgreSQL with ``wal_level=logical`` for the log source's tests, and outboxes set up for it.

The local services run with ``wal_level=logical`` (deploy/local/services.sh), so the shared server
is used when it has it. A server started before that setting existed is not restarted under other
tests' feet: a private cluster (deploy/local/services.sh in ``.local/private-logical``, on a free
loopback port) serves these tests instead, and stops at the end of the session.
``HARVESTER_TEST_LOGICAL_PG_DSN`` names another server with logical decoding.
"""

from __future__ import annotations

import os
import time
from collections.abc import Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pydantic import ByteSize

from harvester import HarvesterConfig, Limits, MessageStasher, OutboxRecord
from harvester.postgres.log import logical
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import ensure, fence_table, migrate
from tests.support.harvesters import HarvesterFactory, harvesters
from tests.support.names import unique
from tests.support.ports import free_ports
from tests.support.private_services import PrivatePostgres
from tests.support.services import Services

# The suite's PostgreSQL is a single server: a failover would lose a table-less outbox's records not
# yet delivered, which a table-less harvester refuses unless told (docs/log-source.md#failover).
SINGLE_SERVER: dict[str, Any] = {"log_accept_loss_on_failover": True}


def _logical(dsn: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SHOW wal_level").fetchone()
    return row is not None and row[0] == "logical"


@pytest.fixture(scope="session")
def logical_dsn(services: Services) -> Iterator[str]:
    given = os.environ.get("HARVESTER_TEST_LOGICAL_PG_DSN")
    if given:
        yield given
        return
    if _logical(services.pg_dsn):
        yield services.pg_dsn
        return
    private = PrivatePostgres("logical", free_ports(1))
    private.start()
    try:
        yield private.dsn
    finally:
        private.stop()


@pytest.fixture
def log_outbox(logical_dsn: str) -> Iterator[TableName]:
    """A migrated outbox with its publication and slot (``reaper migrate``'s work), removed afterwards."""
    schema = unique("t")
    table = TableName(schema, "outbox")
    config = HarvesterConfig(outbox_table=table.qualified)
    setup = logical.LogSetup(table, config.slot, config.publication)
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        migrate(conn, table)
        logical.create(conn, setup)
    yield table
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        drop_slot(conn, setup.slot)
        conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(setup.publication)))
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def drop_slot(conn: psycopg.Connection[Any], slot: str) -> None:
    """Drop ``slot``, first ending its reader (a stream a stopped harvester closed may still be exiting)."""
    for _ in range(100):
        row = conn.execute(
            "SELECT active, pg_terminate_backend(active_pid) FROM pg_replication_slots WHERE slot_name = %s", (slot,)
        ).fetchone()
        if row is None:
            return
        if not row[0]:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            return
        time.sleep(0.05)
    raise AssertionError(f"replication slot {slot} stayed active")


@pytest.fixture
def make_log_harvester(services: Services, logical_dsn: str, log_outbox: TableName) -> Iterator[HarvesterFactory]:
    """Build (and afterwards stop) log-source harvesters on this test's outbox."""

    def config(
        *,
        delivery: Any = "at_least_once",
        producer: dict[str, Any] | None = None,
        dsn: str = logical_dsn,
        memory: int = 1 << 30,
        **limits: Any,
    ) -> HarvesterConfig:
        return HarvesterConfig(
            data_source=dsn,
            outbox_table=log_outbox.qualified,
            source="log",
            log_transaction_memory=ByteSize(memory),
            delivery=delivery,
            base_kafka_config={"bootstrap.servers": services.bootstrap},
            producer_kafka_config=producer or {},
            limits=Limits(**{"io_error_backoff": "100ms", **limits}),
        )

    with harvesters(config) as make:
        yield make


def slot_position(dsn: str, table: TableName) -> str:
    """The slot's confirmed position (an LSN's text)."""
    slot = HarvesterConfig(outbox_table=table.qualified).slot
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT confirmed_flush_lsn::text FROM pg_replication_slots WHERE slot_name = %s", (slot,))
        found = row.fetchone()
    assert found is not None
    return str(found[0])


def stored_done(dsn: str, table: TableName) -> int:
    """The log position the outbox's fence row stores done (a table-less outbox, a retention window)."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(
            sql.SQL("SELECT log_lsn FROM {} WHERE outbox_table = %s").format(fence_table(table).ident),
            (table.qualified,),
        ).fetchone()
    return int(row[0]) if row else 0


def tableless() -> dict[str, Any]:
    """The settings (HarvesterConfig fields) of a harvester of a table-less outbox: the one place to
    add what its start will require."""
    return {"source": "log", "log_messages": True, **SINGLE_SERVER}


@pytest.fixture
def message_outbox(logical_dsn: str) -> Iterator[TableName]:
    """A table-less outbox as ``reaper migrate`` leaves it: fence and dead-letter tables, an empty
    publication and the slot; removed afterwards."""
    table = TableName(unique("t"), "outbox")
    config = HarvesterConfig(outbox_table=table.qualified, source="log", log_messages=True)
    setup = logical.LogSetup(table, config.slot, config.publication, config.prefix)
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        ensure(conn, table, "fence")
        ensure(conn, table, "dead_letter", value_type="BYTEA")
        logical.create(conn, setup)
    yield table
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        drop_slot(conn, setup.slot)
        conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(setup.publication)))
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(table.schema or "")))


def stash(dsn: str, table: TableName, records: list[tuple[str, str, str]]) -> None:
    """One committed transaction writing ``records`` (topic, key, value) as messages."""
    with psycopg.connect(dsn) as conn:
        MessageStasher(table).stash(conn, [OutboxRecord(topic=t, key=k, value=v) for t, k, v in records])

"""A slot the server invalidated (``max_slot_wal_keep_size`` exceeded while nobody read it:
``wal_status = 'lost'``), recovered from the table like a dropped one (harvester/postgres/log/recovery.py): with
per-batch deletes and with a retention window, nothing lost, every key in order, and the new slot
streamed after. A private server: the setting would invalidate other tests' slots on the shared one."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest

from harvester import HarvesterConfig
from harvester.postgres.log import logical
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import migrate
from tests.engine.workload import check, insert, wait_until
from tests.log.test_lost_slot import made, recoveries
from tests.support.kafka import read_messages
from tests.support.names import unique
from tests.support.ports import free_ports
from tests.support.private_services import PrivatePostgres
from tests.support.services import Services

pytestmark = pytest.mark.integration


@pytest.fixture(scope="module")
def small_wal_dsn() -> Iterator[str]:
    """A server that keeps at most 1 MB of WAL for a slot (invalidated at the next checkpoint past it)."""
    server = PrivatePostgres("invalidated-slot", free_ports(1))
    server.start()
    try:
        with psycopg.connect(server.dsn, autocommit=True) as conn:
            conn.execute("ALTER SYSTEM SET max_slot_wal_keep_size = '1MB'")
            conn.execute("SELECT pg_reload_conf()")
        yield server.dsn
    finally:
        server.stop()


def invalidate(dsn: str, slot: str) -> None:
    """Move the log past what the slot may keep (segments switched), then checkpoint: the server
    invalidates it."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        for _ in range(4):
            conn.execute("SELECT pg_logical_emit_message(false, 'filler', repeat('x', 1000))")
            conn.execute("SELECT pg_switch_wal()")
        conn.execute("CHECKPOINT")
        row = conn.execute("SELECT wal_status FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    assert row == ("lost",), row


@pytest.mark.parametrize("settings", [{}, {"log_retention": "10m"}], ids=["deletes", "retention"])
def test_an_invalidated_slot_is_recovered_from_the_table(
    services: Services, small_wal_dsn: str, topics: Callable[..., str], settings: dict[str, Any]
) -> None:
    topic, table = topics(partitions=3), TableName(unique("t"), "outbox")
    slot = HarvesterConfig(outbox_table=table.qualified).slot
    setup = logical.LogSetup(table, slot, HarvesterConfig(outbox_table=table.qualified).publication)
    with psycopg.connect(small_wal_dsn, autocommit=True) as conn:
        migrate(conn, table)
        logical.create(conn, setup)
    rows = [(topic, f"k{i % 5}", f"k{i % 5}:{i // 5}") for i in range(100)]
    insert(small_wal_dsn, table, rows[:50])  # before the slot is invalidated: the slot never shows them
    invalidate(small_wal_dsn, slot)
    insert(small_wal_dsn, table, rows[50:])
    with made(services, small_wal_dsn, table) as make:
        h = make(**settings)
        messages = read_messages(services.bootstrap, [topic], 100)
        verdict = check(messages, {f"k{i}": 20 for i in range(5)})
        assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0, verdict
        assert wait_until(lambda: recoveries(h) == 1)
        insert(small_wal_dsn, table, [(topic, "after", "after:0")])
        assert any(m.key() == b"after" for m in read_messages(services.bootstrap, [topic], 101))

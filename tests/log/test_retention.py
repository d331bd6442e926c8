"""The log source with a retention window: delivered rows stay in the table (only the fence row is
written per batch), then go in one fenced bulk delete of the rows older than a delivered cut, a
fenced old leader deletes none, and a leader that stops cleanly deletes every row it delivered."""

from __future__ import annotations

from uuid import uuid4

import psycopg
import pytest
from psycopg import sql

from harvester import HarvesterConfig
from harvester.compose import log_store
from harvester.core.protocols import FencedError
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.position import StoredPosition
from harvester.postgres.log.retention import RetentionWindow
from harvester.postgres.log.store import LogStore
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import insert, wait_until
from tests.log.conftest import slot_position
from tests.log.test_log_source import mark_all

pytestmark = pytest.mark.integration


def ids_left(dsn: str, table: TableName) -> list[int]:
    with psycopg.connect(dsn, autocommit=True) as conn:
        return [int(r[0]) for r in conn.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(table.ident))]


def window_of(store: LogStore) -> RetentionWindow:
    """The store's retention window (its sweep's steps, called here one by one)."""
    finish = store._finish
    assert isinstance(finish, StoredPosition) and finish._window is not None
    return finish._window


def test_delivered_rows_stay_then_go_in_a_fenced_bulk_delete(logical_dsn: str, log_outbox: TableName) -> None:
    config = HarvesterConfig(outbox_table=log_outbox.qualified)
    setup = LogSetup(log_outbox, config.slot, config.publication)
    store, zombie = log_store(logical_dsn, setup, retention=3600), log_store(logical_dsn, setup, retention=3600)
    insert(logical_dsn, log_outbox, [("t", f"k{i}", f"k{i}:0") for i in range(10)])
    first_ids = ids_left(logical_dsn, log_outbox)
    try:
        store.prepare()
        zombie.prepare()
        zombie.acquire(uuid4())  # an old leader, superseded below
        leader = uuid4()
        store.acquire(leader)
        position = slot_position(logical_dsn, log_outbox)
        store.purge([r.id for r in mark_all(store, leader, 10)])
        # Delivered: the slot moved, the rows stay.
        assert wait_until(lambda: slot_position(logical_dsn, log_outbox) != position)
        assert ids_left(logical_dsn, log_outbox) == first_ids

        def first_rows_delivered_cut() -> bool:
            """More deliveries move the cut on, until it is past the first rows' transaction."""
            insert(logical_dsn, log_outbox, [("t", "k", "k:1")])
            store.purge([r.id for r in mark_all(store, leader, 1)])
            cut = window_of(store)._delivered_cut()
            if cut:
                window_of(store)._delete_older(cut)
            return not set(first_ids) & set(ids_left(logical_dsn, log_outbox))

        with pytest.raises(FencedError):
            window_of(zombie)._delete_older(1 << 40)  # any cut: the fence refuses
        assert ids_left(logical_dsn, log_outbox)[:10] == first_ids
        assert wait_until(first_rows_delivered_cut)
        # A row not delivered yet stays, whatever the cut: it is newer than every cut taken.
        insert(logical_dsn, log_outbox, [("t", "k", "k:2")])
        undelivered = ids_left(logical_dsn, log_outbox)[-1]
        window_of(store)._delete_older(window_of(store)._delivered_cut())
        left = ids_left(logical_dsn, log_outbox)
        assert undelivered in left and min(left) > max(first_ids)
    finally:
        zombie.close()
        store.close()


def test_a_leader_that_stops_cleanly_deletes_every_row_it_delivered(logical_dsn: str, log_outbox: TableName) -> None:
    """Rows delivered after the latest delivered cut go too (a switch back to mark-purge/reset would
    republish them); the rows of a transaction received and not done stay."""
    config = HarvesterConfig(outbox_table=log_outbox.qualified)
    store = log_store(logical_dsn, LogSetup(log_outbox, config.slot, config.publication), retention=3600)
    insert(logical_dsn, log_outbox, [("t", f"k{i}", f"k{i}:0") for i in range(10)])
    delivered = ids_left(logical_dsn, log_outbox)
    try:
        store.prepare()
        leader = uuid4()
        store.acquire(leader)
        store.purge([r.id for r in mark_all(store, leader, 10)])
        insert(logical_dsn, log_outbox, [("t", f"k{i}", f"k{i}:1") for i in range(3)])
        assert len(mark_all(store, leader, 3)) == 3  # handed out, never acknowledged
    finally:
        store.close()
    left = ids_left(logical_dsn, log_outbox)
    assert len(left) == 3 and not set(left) & set(delivered)

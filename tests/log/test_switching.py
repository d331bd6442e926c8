"""Switching an outbox from mark-purge/reset to the log source and back, by the procedure of
docs/log-source.md, while records keep coming: nothing is lost and no key's records are reordered
(records both sources saw may come twice)."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harvester import HarvesterConfig, Limits, OutboxRecord, Stasher
from harvester.postgres.log import logical
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import migrate
from tests.engine.workload import check, wait_drained, wait_until
from tests.log.conftest import drop_slot
from tests.support.harvesters import harvesters
from tests.support.kafka import read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

KEYS = 10


class Writer(threading.Thread):
    """Writes ``k<i>:<seq>`` records, one per transaction, round robin over the keys, until stopped."""

    def __init__(self, dsn: str, table: TableName, topic: str) -> None:
        super().__init__()
        self.dsn, self.table, self.topic = dsn, table, topic
        self.written = 0
        self.stopping = threading.Event()

    def run(self) -> None:
        stasher = Stasher(self.table)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            while not self.stopping.wait(0.005):
                key, seq = f"k{self.written % KEYS}", self.written // KEYS
                stasher.stash(conn, [OutboxRecord(topic=self.topic, key=key, value=f"{key}:{seq}")])
                self.written += 1

    def expected(self) -> dict[str, int]:
        return {f"k{i}": self.written // KEYS + (1 if i < self.written % KEYS else 0) for i in range(KEYS)}


def count(dsn: str, query: sql.Composed) -> int:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query).fetchone()
    return int(row[0]) if row and row[0] is not None else 0


@pytest.mark.parametrize("retention", [0, 1], ids=["per-batch-delete", "retention"])
def test_switching_to_the_log_source_and_back_loses_and_reorders_nothing(
    services: Services, logical_dsn: str, topics: Callable[..., str], retention: int
) -> None:
    """With a retention window, the log reaper's bulk deletes run too before the switch back."""
    schema = unique("t")
    table = TableName(schema, "outbox")
    names = HarvesterConfig(outbox_table=table.qualified)
    setup = logical.LogSetup(table, names.slot, names.publication)
    topic = topics(partitions=3)
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        migrate(conn, table)

    def config(*, source: Any) -> HarvesterConfig:
        return HarvesterConfig(
            data_source=logical_dsn,
            outbox_table=table.qualified,
            source=source,
            log_retention=timedelta(seconds=retention if source == "log" else 0),
            base_kafka_config={"bootstrap.servers": services.bootstrap},
            limits=Limits(io_error_backoff=timedelta(milliseconds=100)),
        )

    writer = Writer(logical_dsn, table, topic)
    try:
        with harvesters(config) as make:
            marking = make(source="mark_purge")
            writer.start()
            assert wait_until(lambda: marking.metrics.purged._value.get() >= 20)
            # 1. 'reaper migrate' with source: log while the mark-purge reaper runs: the slot records
            #    every insert from now on.
            with psycopg.connect(logical_dsn, autocommit=True) as conn:
                logical.create(conn, setup)
            boundary = count(logical_dsn, sql.SQL("SELECT max(id) FROM {}").format(table.ident))
            # 2. Wait until no row older than the slot is left, 3. stop the mark-purge reaper,
            #    4. start the log reaper.
            older = sql.SQL("SELECT count(*) FROM {} WHERE id <= {}").format(table.ident, boundary)
            assert wait_until(lambda: count(logical_dsn, older) == 0)
            marking.stop(timeout=5)
            reading = make(source="log")
            assert wait_until(lambda: reading.metrics.purged._value.get() >= 20)
            if retention:  # a bulk delete ran: the oldest rows the log reaper delivered are gone
                first = count(logical_dsn, sql.SQL("SELECT min(id) FROM {}").format(table.ident))
                oldest = sql.SQL("SELECT count(*) FROM {} WHERE id <= {}").format(table.ident, first)
                assert wait_until(lambda: count(logical_dsn, oldest) == 0)
            # Back: stop the log reaper, start the mark-purge reaper, drop the slot and publication.
            reading.stop(timeout=5)
            marking = make(source="mark_purge")
            written = writer.written
            assert wait_until(lambda: writer.written >= written + 20)
            writer.stopping.set()
            writer.join()
            assert wait_drained(logical_dsn, table) == 0
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            drop_slot(conn, setup.slot)
            conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(setup.publication)))
        expected = writer.expected()
        messages = read_messages(services.bootstrap, [topic], sum(expected.values()))
        verdict = check(messages, expected)
        assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    finally:
        writer.stopping.set()
        if writer.is_alive():
            writer.join()
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            drop_slot(conn, setup.slot)
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(setup.publication)))
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))

"""A lost replication slot (dropped while records are outstanding and more are written): a table's
records are harvested from the table before the new slot is streamed, none lost, every key in order,
none repeated exactly once (read_committed), and with per-batch deletes at least once none repeated
past what ``DedupReader`` drops; a table-less outbox stops with one line (docs/log-source.md, "A lost slot")."""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import Any

import psycopg
import pytest
from confluent_kafka import Message
from psycopg import sql

from harvester import Harvester, HarvesterConfig, Limits
from harvester.client.dedup_state import DedupState
from harvester.core.identity import Identity
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table
from tests.engine.workload import check, insert, wait_drained, wait_until, writing
from tests.faults.proxy import Proxy
from tests.log.conftest import SINGLE_SERVER, stash
from tests.support.harvesters import HarvesterFactory, harvesters
from tests.support.kafka import consumed_headers, read_distinct, read_messages
from tests.support.services import Services

pytestmark = pytest.mark.integration

KEYS, PER_KEY = 20, 150
COMMITTED: dict[str, Any] = {"isolation.level": "read_committed"}


@contextmanager
def made(services: Services, dsn: str, table: TableName) -> Iterator[HarvesterFactory]:
    def config(*, delivery: str = "at_least_once", **settings: Any) -> HarvesterConfig:
        return HarvesterConfig(
            data_source=dsn,
            outbox_table=table.qualified,
            source="log",
            delivery=delivery,  # type: ignore[arg-type]
            base_kafka_config={"bootstrap.servers": services.bootstrap},
            limits=Limits(io_error_backoff="100ms", mark_query_records=50),  # type: ignore[arg-type]
            **settings,
        )

    with harvesters(config) as factory:
        yield factory


@pytest.fixture
def make(services: Services, logical_dsn: str, log_outbox: TableName) -> Iterator[HarvesterFactory]:
    with made(services, logical_dsn, log_outbox) as factory:
        yield factory


def drop_slot(dsn: str, slot: str, lost: Callable[[], bool] = lambda: False) -> None:
    """Drop ``slot`` under its reader's feet. A reader whose stream ends starts it again at once,
    so end the reader and drop the slot the moment it is free, polling (``pg_terminate_backend``'s
    own wait sleeps 100 ms, time enough for the reader to take the slot again); again when the
    reader won, or when its take-over ended this session (the slot active in it while it drops it).
    Once: when ``lost`` says the reader found it gone, the slot there is the one its recovery created."""
    deadline = time.monotonic() + 60
    while time.monotonic() < deadline:
        try:
            with psycopg.connect(dsn, autocommit=True) as conn:
                if lost():
                    return
                while time.monotonic() < deadline:
                    found = conn.execute(
                        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)
                    ).fetchone()
                    if found is None:
                        return
                    if found[0] is None:
                        conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
                        return
                    conn.execute("SELECT pg_terminate_backend(%s)", (found[0],))
                    time.sleep(0.001)
        except (psycopg.errors.ObjectInUse, psycopg.OperationalError):
            time.sleep(0.01)
    raise AssertionError(f"replication slot {slot} stayed active")


def recovering(dsn: str, table: TableName) -> Callable[[], bool]:
    """Whether a recovery of ``table``'s slot began (the fence row's mark, or one is done)."""

    def began() -> bool:
        with psycopg.connect(dsn, autocommit=True) as conn:
            row = conn.execute(
                sql.SQL("SELECT log_recovery_id FROM {} WHERE outbox_table = %s").format(fence_table(table).ident),
                (table.qualified,),
            ).fetchone()
        return row is not None and int(row[0]) != 0

    return began


def past_dedup(messages: list[Message]) -> int:
    """The copies a ``DedupReader`` of default bounds would let through, reading ``messages`` in order."""
    state, seen, left = DedupState(), set(), 0
    for m in messages:
        identity = Identity.from_headers(consumed_headers(m))
        assert identity is not None
        topic = m.topic() or ""
        copy = (topic, m.key(), identity.id)
        if not state.observe((identity.producer, topic, m.key()), identity) and copy in seen:
            left += 1
        seen.add(copy)
    return left


def recoveries(h: Harvester) -> float:
    return h.registry.get_sample_value("harvester_log_slot_recoveries_total") or 0.0


@pytest.mark.parametrize(
    ("delivery", "settings"),
    [("at_least_once", {}), ("exactly_once", {}), ("at_least_once", {"log_retention": "10m"})],
    ids=["deletes-at-least-once", "deletes-exactly-once", "retention-at-least-once"],
)
def test_a_dropped_slot_is_recovered_from_the_table(
    services: Services,
    logical_dsn: str,
    log_outbox: TableName,
    topics: Callable[..., str],
    make: HarvesterFactory,
    delivery: str,
    settings: dict[str, Any],
) -> None:
    topic, total = topics(partitions=3), KEYS * PER_KEY
    h = make(delivery=delivery, **settings)
    slot = HarvesterConfig(outbox_table=log_outbox.qualified).slot
    writer = writing(logical_dsn, log_outbox, topic, keys=KEYS, per_key=PER_KEY, writers=4, per_txn=5)
    try:
        assert wait_until(lambda: h.metrics.purged._value.get() >= total // 5, timeout=60)
        # Records outstanding, more being written.
        drop_slot(logical_dsn, slot, lambda: recovering(logical_dsn, log_outbox)() or recoveries(h) > 0)
    finally:
        writer.join()
    messages = read_distinct(services.bootstrap, topic, total, **COMMITTED)
    assert wait_until(lambda: recoveries(h) == 1)
    verdict = check(messages, {f"k{i}": PER_KEY for i in range(KEYS)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0, verdict
    if delivery == "exactly_once":
        assert verdict.duplicates == 0
    elif not settings:  # a retention window's harvest can repeat more (docs/log-source.md, "A lost slot")
        assert past_dedup(messages) == 0
    if not settings:
        assert wait_drained(logical_dsn, log_outbox) == 0
    # The new slot is streamed: a record written now comes through it.
    insert(logical_dsn, log_outbox, [(topic, "after", "after:0")])
    assert any(m.key() == b"after" for m in read_messages(services.bootstrap, [topic], total + 1, **COMMITTED))


def test_a_table_less_outbox_stops_when_its_slot_is_lost(
    services: Services, logical_dsn: str, message_outbox: TableName, topics: Callable[..., str]
) -> None:
    topic = topics()
    with made(services, logical_dsn, message_outbox) as make:
        h = make(log_messages=True, **SINGLE_SERVER)
        stash(logical_dsn, message_outbox, [(topic, "k", "k:0")])
        assert wait_until(lambda: h.metrics.purged._value.get() >= 1, timeout=60)
        drop_slot(logical_dsn, HarvesterConfig(outbox_table=message_outbox.qualified).slot)
        assert wait_until(lambda: h.failure is not None, timeout=60)
    assert h.failure is not None and "may be lost" in h.failure and "reaper migrate" in h.failure, h.failure
    assert "\n" not in h.failure


@pytest.mark.parametrize("state", ["dropped", "recreated-mid-recovery"])
def test_a_leader_recovers_a_slot_lost_before_its_term(
    services: Services,
    logical_dsn: str,
    log_outbox: TableName,
    topics: Callable[..., str],
    make: HarvesterFactory,
    state: str,
) -> None:
    # Rows the slot never showed (written while it was gone), then a leader starts: with the slot
    # absent, or recreated by a leader that died before its harvest ended (the fence row says so).
    topic = topics()
    setup = LogSetup(log_outbox, HarvesterConfig(outbox_table=log_outbox.qualified).slot, "")
    drop_slot(logical_dsn, setup.slot)
    insert(logical_dsn, log_outbox, [(topic, "k", f"k:{i}") for i in range(50)])
    if state == "recreated-mid-recovery":
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (setup.slot,))
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (outbox_table, shard, shards, epoch, leader_id, log_recovery_id)"
                    " VALUES (%s, 0, 1, 1, gen_random_uuid(), -1)"
                ).format(fence_table(log_outbox).ident),
                (log_outbox.qualified,),
            )
    insert(logical_dsn, log_outbox, [(topic, "k", f"k:{i}") for i in range(50, 100)])
    h = make()
    messages = read_messages(services.bootstrap, [topic], 100)
    verdict = check(messages, {"k": 100})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0, verdict
    assert wait_until(lambda: recoveries(h) == 1)
    insert(logical_dsn, log_outbox, [(topic, "k", "k:100")])
    assert len(read_messages(services.bootstrap, [topic], 101)) == 101


def test_a_slot_the_server_refuses_to_stream_is_retried_not_recovered(
    services: Services, logical_dsn: str, log_outbox: TableName, topics: Callable[..., str]
) -> None:
    # START_REPLICATION answers object_not_in_prerequisite_state (55000) for an invalidated slot, and
    # as much for one it cannot stream now that is not lost: here a slot of the same name in another
    # database ("was not created in this database"; wal_level below logical, a standby still
    # synchronizing the slot are others). That is a retry, not a recovery (which would harvest the
    # table again at every start of the stream).
    topic, setup = topics(), LogSetup(log_outbox, HarvesterConfig(outbox_table=log_outbox.qualified).slot, "")
    params = psycopg.conninfo.conninfo_to_dict(logical_dsn)
    proxy = Proxy((str(params.get("host", "127.0.0.1")), int(str(params.get("port", 5432)))))
    other_db = psycopg.conninfo.make_conninfo(logical_dsn, dbname="postgres")
    try:
        with made(services, psycopg.conninfo.make_conninfo(logical_dsn, port=proxy.port), log_outbox) as make:
            h = make()
            insert(logical_dsn, log_outbox, [(topic, "k", f"k:{i}") for i in range(20)])
            assert len(read_messages(services.bootstrap, [topic], 20)) == 20
            assert wait_until(lambda: h.metrics.purged._value.get() >= 20)
            proxy.set_mode("cut")  # the leader's take-over does not see the slot missing meanwhile
            drop_slot(logical_dsn, setup.slot)
            with psycopg.connect(other_db, autocommit=True) as conn:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (setup.slot,))
            retries = h.registry.get_sample_value("harvester_store_retries_total", {"operation": "mark"}) or 0.0
            proxy.set_mode("pass")

            def refused() -> float:
                now = h.registry.get_sample_value("harvester_store_retries_total", {"operation": "mark"}) or 0.0
                return now - retries

            assert wait_until(lambda: refused() >= 3 or recoveries(h) > 0, timeout=60)
            assert recoveries(h) == 0 and not recovering(logical_dsn, log_outbox)()
            # The operator's fix (the other database's slot goes, the outbox's is created again),
            # out of the leader's sight again: it then streams the new slot.
            proxy.set_mode("cut")
            drop_slot(other_db, setup.slot)
            with psycopg.connect(logical_dsn, autocommit=True) as conn:
                conn.execute("SELECT pg_create_logical_replication_slot(%s, 'pgoutput')", (setup.slot,))
            proxy.set_mode("pass")
            insert(logical_dsn, log_outbox, [(topic, "k", f"k:{i}") for i in range(20, 40)])
            verdict = check(read_messages(services.bootstrap, [topic], 40), {"k": 40})
            assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0, verdict
            assert recoveries(h) == 0
    finally:
        proxy.close()
        drop_slot(other_db, setup.slot)

"""The epoch fence in the database: after a newer leader's bump commits, an older epoch changes nothing."""

from __future__ import annotations

import contextlib
import threading
import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from harvester import Engine, Limits, PostgresStore
from harvester.core.at_least_once import at_least_once
from harvester.core.events import Event, LeaderFenced
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import DeliveryCallback, FencedError
from harvester.core.records import Failure
from harvester.kafka.publisher import KafkaPublisher, producer_config
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import insert, wait_until
from tests.support.harvesters import ManualElector
from tests.support.kafka import read_messages
from tests.support.services import Services

pytestmark = pytest.mark.integration


def snapshot(dsn: str, table: TableName) -> list[tuple[object, ...]]:
    with psycopg.connect(dsn) as conn:
        return conn.execute(sql.SQL("SELECT * FROM {} ORDER BY id").format(table.ident)).fetchall()


def test_older_epoch_cannot_mark_or_purge(services: Services, outbox: TableName) -> None:
    insert(services.pg_dsn, outbox, [("t", f"k{i}", "v") for i in range(10)])
    old, new = PostgresStore.open(services.pg_dsn, outbox), PostgresStore.open(services.pg_dsn, outbox)
    try:
        old_leader = uuid.uuid4()
        assert old.acquire(old_leader) == 1
        marked = old.mark(old_leader, 5)
        assert [r.id for r in marked] == [r[0] for r in snapshot(services.pg_dsn, outbox)][:5]
        assert new.acquire(uuid.uuid4()) == 2
        before = snapshot(services.pg_dsn, outbox)
        with pytest.raises(FencedError):
            old.mark(uuid.uuid4(), 5)
        with pytest.raises(FencedError):
            old.purge([r.id for r in marked])
        old.reset([r.id for r in marked])  # a reset writes nothing: there is no mark to undo
        assert snapshot(services.pg_dsn, outbox) == before
    finally:
        old.close()
        new.close()


def test_a_zombie_that_keeps_its_connection_changes_no_row_the_new_leader_owns(
    services: Services, outbox: TableName
) -> None:
    """A leader cut from its group, not from PostgreSQL (its elector stalled: nobody told it) goes on
    with its batch in flight after a newer leader took the fence and marked the same rows: its purge
    (ids far apart and a dense range: two statements), checkpointed purge, failure count and dead
    letter each change nothing, and the rows stay until the new leader purges them after publishing."""
    insert(services.pg_dsn, outbox, [("t", f"k{i % 3}", f"v{i}") for i in range(12)])
    zombie = PostgresStore.open(services.pg_dsn, outbox, application_name="zombie")
    heir = PostgresStore.open(services.pg_dsn, outbox)
    try:
        zombie_id, heir_id = uuid.uuid4(), uuid.uuid4()
        zombie.acquire(zombie_id)
        batch = [r.id for r in zombie.mark(zombie_id, 12)]
        assert len(batch) == 12
        heir.acquire(heir_id)
        assert [r.id for r in heir.mark(heir_id, 12)] == batch  # the new leader's batch now

        def failures(ids: list[int]) -> list[Failure]:
            return [Failure(i, "k", "poison", "refused", 1, None) for i in ids]

        acts: dict[str, Callable[[], None]] = {
            "purge of ids far apart": lambda: zombie.purge([batch[0], batch[11]]),
            "purge of a dense range": lambda: zombie.purge(batch[1:5]),
            "checkpointed purge": lambda: zombie.purge_checkpointed(batch[5:7], 10**9),
            "failure count": lambda: zombie.fail(failures(batch[7:9])),
            "dead letter": lambda: zombie.dead_letter(failures(batch[9:11]), zombie_id),
        }
        changed = []
        for name, act in acts.items():
            before = snapshot(services.pg_dsn, outbox)
            with contextlib.suppress(FencedError):  # it may learn it is fenced; it must change nothing
                act()
            if snapshot(services.pg_dsn, outbox) != before:
                changed.append(name)
        assert changed == []
        heir.purge(batch)  # published by the new leader: every row was still there for it
        assert snapshot(services.pg_dsn, outbox) == []
    finally:
        zombie.close()
        heir.close()


def test_bump_waits_for_a_running_statement_and_fences_the_next(services: Services, outbox: TableName) -> None:
    """The share lock: a bump queued behind an old-epoch transaction commits after it; from then on
    the old epoch is refused."""
    insert(services.pg_dsn, outbox, [("t", "k", "v")])
    old = PostgresStore.open(services.pg_dsn, outbox)
    leader = uuid.uuid4()
    epoch = old.acquire(leader)
    fence = sql.SQL("SELECT 1 FROM {} WHERE outbox_table = %s AND epoch = %s FOR SHARE").format(
        TableName(outbox.schema, "harvester_fence").ident
    )
    bumped = threading.Event()
    with psycopg.connect(services.pg_dsn) as holder:
        holder.execute(fence, (outbox.qualified, epoch))  # an old-epoch transaction in progress

        def bump() -> None:
            PostgresStore.open(services.pg_dsn, outbox).acquire(uuid.uuid4())
            bumped.set()

        t = threading.Thread(target=bump)
        t.start()
        assert not bumped.wait(0.5)  # the bump waits for the share lock
        holder.commit()
        t.join(10)
    assert bumped.is_set()
    with pytest.raises(FencedError):
        old.mark(leader, 10)
    old.close()


def run_engine(
    services: Services, outbox: TableName, events: list[Event], leads: list[bool]
) -> tuple[Engine, PostgresStore, HarvesterMetrics]:
    store = PostgresStore.open(services.pg_dsn, outbox)
    metrics = HarvesterMetrics()

    def publisher(cb: DeliveryCallback) -> KafkaPublisher:
        return KafkaPublisher(producer_config({"bootstrap.servers": services.bootstrap}, {}), cb)

    mode = at_least_once(store, publisher)
    engine = Engine(store, mode, Limits(), metrics, events.append, still_leader=lambda: leads[0])
    engine.start()
    ManualElector().start(engine.on_leader_event)
    return engine, store, metrics


def test_engine_drops_leader_work_when_a_newer_leader_fenced_it(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    topic = topics()
    events: list[Event] = []
    leads = [True]
    engine, store, metrics = run_engine(services, outbox, events, leads)
    insert(services.pg_dsn, outbox, [(topic, "k", "k:0")])
    assert len(read_messages(services.bootstrap, [topic], 1)) == 1
    assert wait_until(lambda: snapshot(services.pg_dsn, outbox) == [])
    leads[0] = False  # the elector no longer sees its heartbeats ...
    intruder = PostgresStore.open(services.pg_dsn, outbox)
    intruder.acquire(uuid.uuid4())  # ... and a newer leader takes over the outbox
    insert(services.pg_dsn, outbox, [(topic, "k", "k:1")])
    assert wait_until(lambda: any(isinstance(e, LeaderFenced) for e in events))
    assert engine.leader_id is None
    assert metrics.fenced_statements._value.get() >= 1
    assert len(snapshot(services.pg_dsn, outbox)) == 1  # the new record stays for the new leader ...
    assert metrics.published._value.get() == 1  # ... and the fenced engine never published it
    engine.close(5)
    store.close()
    intruder.close()


def test_leader_takes_the_fence_back_from_a_stale_instance(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    """A paused instance finishing its term start late bumps the epoch while this process still
    leads: the leader bumps it again and goes on; the stale instance is the one fenced."""
    topic = topics()
    events: list[Event] = []
    engine, store, metrics = run_engine(services, outbox, events, [True])
    insert(services.pg_dsn, outbox, [(topic, "k", "k:0")])
    assert len(read_messages(services.bootstrap, [topic], 1)) == 1
    stale = PostgresStore.open(services.pg_dsn, outbox)
    stale_leader = uuid.uuid4()
    stale.acquire(stale_leader)
    insert(services.pg_dsn, outbox, [(topic, "k", "k:1")])
    assert wait_until(lambda: snapshot(services.pg_dsn, outbox) == [])  # k:1 harvested after all
    assert [m.value() for m in read_messages(services.bootstrap, [topic], 2)] == [b"k:0", b"k:1"]
    assert not any(isinstance(e, LeaderFenced) for e in events) and engine.leader_id is not None
    assert metrics.fenced_statements._value.get() >= 1
    with pytest.raises(FencedError):
        stale.mark(stale_leader, 10)
    engine.close(5)
    store.close()
    stale.close()

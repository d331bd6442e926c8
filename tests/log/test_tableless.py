"""The table-less outbox against a real PostgreSQL with logical decoding and a real Kafka: records
stashed as logical messages are published in commit order with nothing lost (a late-committing
transaction included), a malformed payload goes to the dead-letter table, a fenced old leader moves
neither the slot nor the stored position, a new leader skips what an earlier one stored done even
when the slot's confirmation never reached the server, and leaders killed and paused in turn lose,
reorder and (exactly once) duplicate nothing."""

from __future__ import annotations

import asyncio
import os
import signal
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any
from uuid import uuid4

import psycopg
import pytest
from psycopg import sql
from sqlalchemy import create_engine
from sqlalchemy.orm import Session

from harvester import AsyncMessageStasher, HarvesterConfig, Limits, MessageStasher, OutboxRecord
from harvester.compose import log_store
from harvester.core.protocols import FencedError
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.position import StoredPosition
from harvester.postgres.schema.deadletter import replay_messages
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table
from tests.engine.workload import check, wait_until
from tests.log.conftest import SINGLE_SERVER, slot_position, stash, stored_done
from tests.log.test_log_source import COMMITTED, DELIVERY, mark_all, slot_reader
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.harvesters import HarvesterFactory, harvesters
from tests.support.kafka import read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration


def setup_of(table: TableName) -> LogSetup:
    config = HarvesterConfig(outbox_table=table.qualified, source="log", log_messages=True, **SINGLE_SERVER)
    return LogSetup(table, config.slot, config.publication, config.prefix, config.log_accept_loss_on_failover)


@pytest.fixture
def make_message_harvester(
    services: Services, logical_dsn: str, message_outbox: TableName
) -> Iterator[HarvesterFactory]:
    def config(*, delivery: Any = "at_least_once", **limits: Any) -> HarvesterConfig:
        return HarvesterConfig(
            data_source=logical_dsn,
            outbox_table=message_outbox.qualified,
            source="log",
            log_messages=True,
            **SINGLE_SERVER,
            delivery=delivery,
            base_kafka_config={"bootstrap.servers": services.bootstrap},
            limits=Limits(**{"io_error_backoff": "100ms", **limits}),
        )

    with harvesters(config) as make:
        yield make


@DELIVERY
def test_records_go_out_in_commit_order_and_a_malformed_payload_is_dead_lettered(
    services: Services,
    logical_dsn: str,
    message_outbox: TableName,
    topics: Callable[..., str],
    make_message_harvester: HarvesterFactory,
    delivery: str,
) -> None:
    topic = topics(partitions=3)
    h = make_message_harvester(delivery=delivery)
    with psycopg.connect(logical_dsn) as late:
        # The late transaction writes first (lower LSNs, so lower ids) the key's seq 3..5, and
        # commits after the one writing seq 0..2: commit order puts 0..2 first.
        records = [OutboxRecord(topic=topic, key="late", value=f"late:{i}") for i in (3, 4, 5)]
        MessageStasher(message_outbox).stash(late, records)
        stash(logical_dsn, message_outbox, [(topic, "late", f"late:{i}") for i in (0, 1, 2)])
        for batch in range(5):
            rows = [(topic, f"k{i % 5}", f"k{i % 5}:{batch * 4 + i // 5}") for i in range(20)]
            stash(logical_dsn, message_outbox, rows)
        prefix = setup_of(message_outbox).prefix
        assert prefix is not None
        late.execute("SELECT pg_logical_emit_message(true, %s, %s::bytea)", (prefix, b"\x07not a record"))
        late.commit()
    expected = {f"k{i}": 20 for i in range(5)} | {"late": 6}
    verdict = check(read_messages(services.bootstrap, [topic], 106, **COMMITTED), expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    if delivery == "exactly_once":
        assert verdict.duplicates == 0
    dead = dead_letter_table(message_outbox)

    def dead_lettered() -> list[tuple[Any, ...]]:
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            rows = conn.execute(sql.SQL("SELECT kafka_value, reason FROM {}").format(dead.ident)).fetchall()
        return [(bytes(v), r) for v, r in rows]

    assert wait_until(lambda: len(dead_lettered()) == 1)
    value, reason = dead_lettered()[0]
    assert value == b"\x07not a record" and "malformed" in reason
    if delivery == "at_least_once":  # 'reaper dlq replay' writes it again as a message: dead-lettered again
        with psycopg.connect(logical_dsn) as conn:
            [again] = replay_messages(conn, message_outbox, None, prefix)
        assert wait_until(lambda: [r[0] for r in dead_lettered()] == [b"\x07not a record"])
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            assert conn.execute(sql.SQL("SELECT id FROM {}").format(dead.ident)).fetchall() == [(again,)]
    # Everything is done: the position is stored, then the slot confirmed there.
    assert wait_until(lambda: stored_done(logical_dsn, message_outbox) > 0)
    assert wait_until(lambda: h.metrics.purged._value.get() >= 106)


def test_a_fenced_reader_moves_neither_the_slot_nor_the_stored_position(
    logical_dsn: str, message_outbox: TableName
) -> None:
    setup = setup_of(message_outbox)
    stash(logical_dsn, message_outbox, [("t", f"k{i}", f"k{i}:0") for i in range(10)])
    old, new = log_store(logical_dsn, setup), log_store(logical_dsn, setup)
    try:
        old.prepare()
        new.prepare()
        old_leader = uuid4()
        old.acquire(old_leader)
        records = mark_all(old, old_leader, 10)
        assert len(records) == 10
        zombie_reader = slot_reader(logical_dsn, message_outbox)
        position = slot_position(logical_dsn, message_outbox)
        stored = stored_done(logical_dsn, message_outbox)
        new_leader = uuid4()
        new.acquire(new_leader)
        assert slot_reader(logical_dsn, message_outbox) != zombie_reader
        with pytest.raises(FencedError):
            old.purge([r.id for r in records])
        with pytest.raises(FencedError):
            old.purge_checkpointed([r.id for r in records], 10)
        assert slot_position(logical_dsn, message_outbox) == position
        assert stored_done(logical_dsn, message_outbox) == stored
        # The new leader reads the same records.
        assert [r.id for r in mark_all(new, new_leader, 10)] == [r.id for r in records]
    finally:
        old.close()
        new.close()


def test_a_new_leader_skips_what_was_stored_done_though_the_slot_never_heard(
    logical_dsn: str, message_outbox: TableName
) -> None:
    """The old leader stored its position done under the fence, but its confirmation never reached
    the server (the stream broke): the slot still stands before those records, and a new leader
    publishes none of them again, only what came after."""
    setup = setup_of(message_outbox)
    stash(logical_dsn, message_outbox, [("t", f"k{i}", f"k{i}:0") for i in range(5)])
    first, second = log_store(logical_dsn, setup), log_store(logical_dsn, setup)
    try:
        first.prepare()
        second.prepare()
        leader = uuid4()
        first.acquire(leader)
        records = mark_all(first, leader, 5)
        position = slot_position(logical_dsn, message_outbox)
        with first.state:
            end = first.txns.completed([r.id for r in records], 0)
        assert isinstance(first._finish, StoredPosition)
        first._finish.store(end, 0)  # stored, never confirmed to the slot
        assert slot_position(logical_dsn, message_outbox) == position
        stash(logical_dsn, message_outbox, [("t", "k", "k:1")])
        second_leader = uuid4()
        second.acquire(second_leader)
        again = mark_all(second, second_leader, 1)
        assert [r.value for r in again] == [b"k:1"]
        assert second.mark(second_leader, 100) == []
        second.purge([r.id for r in again])
        assert wait_until(lambda: slot_position(logical_dsn, message_outbox) != position)
    finally:
        first.close()
        second.close()


def test_every_stasher_writes_what_the_store_reads_in_order_and_a_rollback_writes_nothing(
    logical_dsn: str, message_outbox: TableName
) -> None:
    """SQLAlchemy (session and connection) and asyncio psycopg, besides the plain psycopg above."""
    engine = create_engine("postgresql+psycopg://", creator=lambda: psycopg.connect(logical_dsn))
    stasher = MessageStasher(message_outbox)
    with Session(engine) as session, session.begin():
        stasher.stash_sqlalchemy(session, [OutboxRecord.of("t", "s", f"s:{i}", {"h": "v"}) for i in range(3)])
    with engine.begin() as conn:
        stasher.stash_sqlalchemy(conn, OutboxRecord.of("t", "c", "c:0"))

    async def write() -> None:
        async with await psycopg.AsyncConnection.connect(logical_dsn) as conn:
            async with conn.transaction():
                await AsyncMessageStasher(message_outbox).stash(conn, [OutboxRecord.of("t", "a", None)])
            await AsyncMessageStasher(message_outbox).stash(conn, OutboxRecord.of("t", "a", "rolled back"))
            await conn.rollback()

    asyncio.run(write())
    engine.dispose()
    store = log_store(logical_dsn, setup_of(message_outbox))
    try:
        store.prepare()
        leader = uuid4()
        store.acquire(leader)
        got = [(r.key, r.value, r.headers) for r in mark_all(store, leader, 5)]
        assert store.mark(leader, 10) == []
    finally:
        store.close()
    assert got == [("s", f"s:{i}".encode(), [("h", b"v")]) for i in range(3)] + [("c", b"c:0", []), ("a", None, [])]


class MessageWriter(threading.Thread):
    """Stashes ``k<i>:<seq>`` records, one transaction each, round robin over ``keys`` keys."""

    def __init__(self, dsn: str, table: TableName, topic: str, keys: int, per_key: int) -> None:
        super().__init__()
        self.dsn, self.table, self.topic, self.keys, self.per_key = dsn, table, topic, keys, per_key

    def run(self) -> None:
        stasher = MessageStasher(self.table)
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            for n in range(self.keys * self.per_key):
                key = f"k{n % self.keys}"
                stasher.stash(conn, OutboxRecord(topic=self.topic, key=key, value=f"{key}:{n // self.keys}"))
                time.sleep(0.002)


@pytest.mark.slow
def test_failover_resumes_after_what_was_stored_done_with_nothing_lost(
    services: Services, logical_dsn: str, message_outbox: TableName, topics: Callable[..., str]
) -> None:
    """Exactly once (the stricter mode; at least once shares the stored position): SIGKILL the
    leader mid-stream, then SIGSTOP the next one past its session; each successor resumes after the
    stored position, and nothing is lost, reordered or published twice."""
    delivery = "exactly_once"
    topic = topics(partitions=3)
    group = unique("msgfail")

    def spec(name: str) -> dict[str, object]:
        limits = {"mark_query_records": 10, "max_in_flight_records": 50}
        return harvester_spec(
            logical_dsn, services.bootstrap, message_outbox, group, name,
            source="log", log_messages=True, **SINGLE_SERVER, delivery=delivery, limits=limits,
        )  # fmt: skip

    a = HarvesterProcess(spec("killed-a"))
    b = c = None
    try:
        assert a.wait_for("LeaderAcquired"), a.log
        b = HarvesterProcess(spec("paused-b"))
        assert b.wait_for("started")
        writer = MessageWriter(logical_dsn, message_outbox, topic, keys=20, per_key=40)
        writer.start()
        assert wait_until(lambda: stored_done(logical_dsn, message_outbox) > 0, timeout=60)
        a.proc.kill()
        assert b.wait_for("LeaderAcquired", timeout=30), b.log
        c = HarvesterProcess(spec("standby-c"))
        assert c.wait_for("started")
        taken = stored_done(logical_dsn, message_outbox)
        assert wait_until(lambda: stored_done(logical_dsn, message_outbox) > taken, timeout=60)
        os.kill(b.proc.pid, signal.SIGSTOP)
        assert c.wait_for("LeaderAcquired", timeout=30), c.log
        time.sleep(2.0)
        os.kill(b.proc.pid, signal.SIGCONT)
        writer.join()
        messages = read_messages(services.bootstrap, [topic], 800, timeout=90, **COMMITTED)
    finally:
        for p in (a, b, c):
            if p is not None:
                p.terminate()
    verdict = check(messages, {f"k{i}": 40 for i in range(20)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    assert verdict.duplicates == 0

"""The log source against a real PostgreSQL with logical decoding and a real Kafka: it drains in
commit order, never loses a late-committing transaction, moves neither slot nor table once fenced,
and a new leader resumes at the slot's position with nothing lost."""

from __future__ import annotations

import os
import signal
import threading
import time
from collections.abc import Callable
from typing import Any
from uuid import UUID, uuid4

import psycopg
import pytest
from psycopg import sql

from harvester import HarvesterConfig, OutboxRecord, Stasher
from harvester.compose import log_store
from harvester.core.identity import KEY_RUN
from harvester.core.protocols import FencedError, StoreError, StoreUnreachableError
from harvester.core.records import MarkedRecord
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.store import LogStore
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.table.store import PostgresStore
from tests.chaos import audit
from tests.engine.workload import check, insert, wait_drained, wait_until, writing
from tests.log.conftest import slot_position, stored_done
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.harvesters import HarvesterFactory
from tests.support.kafka import read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration


def lsn(dsn: str) -> str:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
    assert row is not None
    return str(row[0])


def at_or_after(dsn: str, a: str, b: str) -> bool:
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT %s::pg_lsn >= %s::pg_lsn", (a, b)).fetchone()
    return row is not None and bool(row[0])


DELIVERY = pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
# Consumer configuration, passed as read_messages(..., **COMMITTED).
COMMITTED: dict[str, Any] = {"isolation.level": "read_committed"}


@DELIVERY
def test_drains_every_key_in_order_and_advances_the_slot(
    services: Services,
    logical_dsn: str,
    log_outbox: TableName,
    topics: Callable[..., str],
    make_log_harvester: HarvesterFactory,
    delivery: str,
) -> None:
    topic = topics(partitions=3)
    h = make_log_harvester(delivery=delivery)
    before = ""
    for batch in range(10):
        before = lsn(logical_dsn)  # the last transaction ends after this
        insert(logical_dsn, log_outbox, [(topic, f"k{i % 7}", f"k{i % 7}:{batch * 10 + i // 7}") for i in range(70)])
    messages = read_messages(services.bootstrap, [topic], 700, **COMMITTED)
    verdict = check(messages, {f"k{i}": 100 for i in range(7)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    if delivery == "exactly_once":
        assert verdict.duplicates == 0
    assert wait_drained(logical_dsn, log_outbox) == 0
    assert wait_until(lambda: not at_or_after(logical_dsn, before, slot_position(logical_dsn, log_outbox)))
    assert h.metrics.purged._value.get() >= 700


@pytest.mark.parametrize(
    ("producer", "per_key"),
    [({}, KEY_RUN), ({"delivery.timeout.ms": 60000}, 1)],
    ids=["in-order", "with-a-delivery-timeout"],
)
def test_a_key_has_several_records_in_flight_unless_a_delivery_timeout_is_set(
    services: Services,
    logical_dsn: str,
    log_outbox: TableName,
    topics: Callable[..., str],
    make_log_harvester: HarvesterFactory,
    producer: dict[str, Any],
    per_key: int,
) -> None:
    # A delivery timeout can let a key's later record land without an earlier one: then one at a time.
    topic = topics(partitions=2)
    h = make_log_harvester(producer=producer)
    peak = 0.0
    done = threading.Event()

    def sample() -> None:
        nonlocal peak
        while not done.is_set():
            peak = max(peak, h.metrics.in_flight._value.get())
            time.sleep(0.002)

    sampler = threading.Thread(target=sample)
    sampler.start()
    try:
        insert(logical_dsn, log_outbox, [(topic, f"k{i % 2}", f"k{i % 2}:{i // 2}") for i in range(4000)])
        messages = read_messages(services.bootstrap, [topic], 4000)
    finally:
        done.set()
        sampler.join()
    verdict = check(messages, {"k0": 2000, "k1": 2000})
    assert verdict.lost == [] and verdict.out_of_order == []
    assert (2 < peak <= 2 * per_key) if per_key > 1 else peak <= 2


@DELIVERY
@pytest.mark.parametrize("harvesting", [True, False], ids=["while-harvesting", "in-one-read"])
def test_a_late_transaction_is_published_in_commit_order(
    services: Services,
    logical_dsn: str,
    log_outbox: TableName,
    topics: Callable[..., str],
    make_log_harvester: HarvesterFactory,
    harvesting: bool,
    delivery: str,
) -> None:
    topic = topics()
    with psycopg.connect(logical_dsn) as late:
        # The late transaction takes the lower ids and stays open, holding seq 3..5 of the key ...
        Stasher(log_outbox).stash(late, [OutboxRecord(topic=topic, key="k", value=f"k:{i}") for i in (3, 4, 5)])
        # ... while a later one, with higher ids and seq 0..2, commits first (and, while harvesting,
        # is harvested; else both transactions come in one read of the slot, where id order would
        # put seq 3..5 first).
        h = make_log_harvester(start=harvesting, delivery=delivery)
        insert(logical_dsn, log_outbox, [(topic, "k", f"k:{i}") for i in (0, 1, 2)])
        if harvesting:
            assert len(read_messages(services.bootstrap, [topic], 3, **COMMITTED)) == 3
            assert wait_until(lambda: h.metrics.purged._value.get() >= 3)
        late.commit()
    if not harvesting:
        h.start()
    assert wait_drained(logical_dsn, log_outbox) == 0
    verdict = check(read_messages(services.bootstrap, [topic], 6, **COMMITTED), {"k": 6})
    # Published in commit order: seq 0..5 in order although ids say 3, 4, 5 came first.
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0


def mark_all(store: LogStore, leader: UUID, count: int) -> list[MarkedRecord]:
    """Mark until ``count`` records came (the stream delivers them as the server decodes them)."""
    marked: list[MarkedRecord] = []
    for _ in range(200):
        marked += store.mark(leader, 100)
        if len(marked) >= count:
            break
        store.wait_for_insert(0.1)
    return marked


def slot_reader(dsn: str, table: TableName) -> int | None:
    """The pid of the walsender streaming the outbox's slot, if any."""
    slot = HarvesterConfig(outbox_table=table.qualified).slot
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    return None if row is None or row[0] is None else int(row[0])


def test_a_fenced_reader_moves_neither_the_slot_nor_the_table(logical_dsn: str, log_outbox: TableName) -> None:
    """A paused old leader that wakes after a new one took over: its deletes and its slot moves
    are refused by the fence, its stream was ended by the takeover (even a confirmation sent with
    no check at all moves nothing), and it cannot stream again."""
    config = HarvesterConfig(outbox_table=log_outbox.qualified)
    setup = LogSetup(log_outbox, config.slot, config.publication)
    insert(logical_dsn, log_outbox, [("t", f"k{i}", f"k{i}:0") for i in range(20)])
    old, new = log_store(logical_dsn, setup), log_store(logical_dsn, setup)
    try:
        old.prepare()
        new.prepare()
        old_leader = uuid4()
        old.acquire(old_leader)
        records = mark_all(old, old_leader, 20)
        assert len(records) == 20
        zombie_reader = slot_reader(logical_dsn, log_outbox)
        assert zombie_reader is not None
        position = slot_position(logical_dsn, log_outbox)
        new_leader = uuid4()
        new.acquire(new_leader)  # the old reader is paused past its term: a newer epoch takes over
        assert slot_reader(logical_dsn, log_outbox) != zombie_reader  # the takeover ended its stream
        with pytest.raises(FencedError):
            old.purge([r.id for r in records])
        with pytest.raises(FencedError):
            old._finish.advance_to(1 << 40)  # any target: the fence refuses first
        old.confirm(1 << 40)  # as if it had checked the epoch just before the takeover
        insert(logical_dsn, log_outbox, [("t", "k", "k:1")])
        refused = None
        for _ in range(3):  # its stream is gone; starting another one is fenced
            try:
                old.mark(old_leader, 100)
            except FencedError as exc:
                refused = exc
                break
            except StoreError:
                continue
        assert refused is not None
        assert slot_position(logical_dsn, log_outbox) == position
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            left = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(log_outbox.ident)).fetchone()
        assert left == (21,)
        # The new leader reads the same records from the slot it found unmoved, then the new one.
        assert [r.id for r in mark_all(new, new_leader, 21)] == [r.id for r in records] + [records[-1].id + 1]
    finally:
        old.close()
        new.close()


def deleted_by(dsn: str, trail: TableName, name: str) -> int:
    """Outbox rows the harvester process ``name`` deleted, as the audit recorded them."""
    return sum(1 for c in audit.history(dsn, trail) if c.kind == "DELETE" and c.app.endswith(f" {name}"))


@pytest.mark.slow
@pytest.mark.parametrize(
    ("delivery", "retention"),
    [("at_least_once", 0), ("exactly_once", 0), ("exactly_once", 1)],
    ids=["at_least_once", "exactly_once", "exactly_once-retention"],
)
def test_failover_resumes_at_the_slot_with_nothing_lost(
    services: Services,
    logical_dsn: str,
    log_outbox: TableName,
    topics: Callable[..., str],
    delivery: str,
    retention: int,
) -> None:
    """SIGKILL the leader mid-stream, then SIGSTOP the next one past its session: each successor
    resumes where the slot stands; the paused one changes no row, fence row or slot position after
    the takeover (the chaos runs' audit, tests/chaos/audit.py). With a retention window (1 s),
    delivered rows stay and go in bulk deletes, and a successor resumes after the position stored
    done."""
    topic = topics(partitions=3)
    trail = audit.install(logical_dsn, log_outbox)
    slot = audit.SlotWatch(logical_dsn, HarvesterConfig(outbox_table=log_outbox.qualified).slot)
    group = unique("logfail")

    def spec(name: str) -> dict[str, object]:
        limits = {"mark_query_records": 10, "max_in_flight_records": 50}
        return harvester_spec(
            logical_dsn, services.bootstrap, log_outbox, group, name,
            source="log", delivery=delivery, limits=limits, log_retention=f"{retention}s",
        )  # fmt: skip

    def progress(name: str) -> int:
        """Rows ``name`` deleted; with a retention window (rows stay), the position stored done."""
        return stored_done(logical_dsn, log_outbox) if retention else deleted_by(logical_dsn, trail, name)

    a = HarvesterProcess(spec("killed-a"))
    b = c = None
    slot.start()
    try:
        assert a.wait_for("LeaderAcquired"), a.log
        b = HarvesterProcess(spec("paused-b"))
        assert b.wait_for("started")
        writer = writing(logical_dsn, log_outbox, topic, keys=30, per_key=60, writers=3, per_txn=1)
        assert wait_until(lambda: progress("killed-a") > 0, timeout=60)
        a.proc.kill()
        assert b.wait_for("LeaderAcquired", timeout=30), b.log
        taken = progress("paused-b")
        c = HarvesterProcess(spec("standby-c"))
        assert c.wait_for("started")
        assert wait_until(lambda: progress("paused-b") > taken, timeout=60)
        os.kill(b.proc.pid, signal.SIGSTOP)
        assert c.wait_for("LeaderAcquired", timeout=30), c.log
        time.sleep(2.0)
        os.kill(b.proc.pid, signal.SIGCONT)
        writer.join()
        if not retention:  # with one, delivered rows stay a window or two: the records tell
            assert wait_drained(logical_dsn, log_outbox, timeout=90) == 0
        messages = read_messages(services.bootstrap, [topic], 1800, timeout=90, **COMMITTED)
    finally:
        slot.stop()
        for p in (a, b, c):
            if p is not None:
                p.terminate()
    history = audit.history(logical_dsn, trail) + slot.confirmations()
    terms = [c.app.split()[-1] for c in history if c.kind == audit.TERM]
    assert terms[:3] == ["killed-a", "paused-b", "standby-c"], terms
    assert audit.past_fence(history) == []
    verdict = check(messages, {f"k{i}": 60 for i in range(30)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    if delivery == "exactly_once":
        assert verdict.duplicates == 0


def test_a_large_transaction_comes_in_without_a_mark_per_read(
    logical_dsn: str, log_outbox: TableName, topics: Callable[..., str], make_log_harvester: HarvesterFactory
) -> None:
    """The walsender sends a large transaction a few messages at a time; the leader waits for the
    rest of it in the read instead of ending the mark empty at each (one empty mark per read made
    about one mark per 4 records, a busy loop beside the walsender)."""
    topic, records = topics(), 50_000
    h = make_log_harvester()
    marks = h.metrics.registry.get_sample_value
    wait_until(lambda: (marks("harvester_mark_query_seconds_count") or 0) > 0)
    before = marks("harvester_mark_query_seconds_count") or 0
    with psycopg.connect(logical_dsn) as conn, conn.cursor() as cur:
        columns = sql.SQL("COPY {} (kafka_topic, kafka_key, kafka_value) FROM STDIN").format(log_outbox.ident)
        with cur.copy(columns) as copy:
            for i in range(records):
                copy.write_row((topic, f"k{i % 100}", "v"))
    assert wait_drained(logical_dsn, log_outbox, timeout=120) == 0
    assert h.metrics.purged._value.get() >= records
    # One mark per read was one per 4 records. A mark hands out what the in-flight throttle has room
    # for, so on a loaded machine acknowledgements arriving a few at a time make batches of ~50
    # (1,057 marks in one CI run): the bound is what tells the two apart, not a batch size.
    assert (marks("harvester_mark_query_seconds_count") or 0) - before < records / 12


def test_an_idle_outbox_lets_the_slot_move_past_other_tables_writes(
    services: Services,
    logical_dsn: str,
    log_outbox: TableName,
    topics: Callable[..., str],
    make_log_harvester: HarvesterFactory,
) -> None:
    topic = topics()
    make_log_harvester()
    insert(logical_dsn, log_outbox, [(topic, "k", "k:0")])
    assert len(read_messages(services.bootstrap, [topic], 1)) == 1
    other = TableName(log_outbox.schema, "other")
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE TABLE {} AS SELECT i FROM generate_series(1, 10000) i").format(other.ident))
    written = lsn(logical_dsn)
    # The idle leader's keepalive (every 10 s) lets the slot pass the other table's writes.
    assert wait_until(lambda: at_or_after(logical_dsn, slot_position(logical_dsn, log_outbox), written), timeout=40)


def test_a_new_pass_hands_out_what_is_not_done_and_the_slot_moves_when_all_is(
    logical_dsn: str, log_outbox: TableName
) -> None:
    """A remark (a new leader id) reads the unadvanced transactions again, without the records
    already acknowledged; the slot moves only once every record of a transaction is done."""
    config = HarvesterConfig(outbox_table=log_outbox.qualified)
    insert(logical_dsn, log_outbox, [("t", f"k{i}", f"k{i}:0") for i in range(10)])
    store = log_store(logical_dsn, LogSetup(log_outbox, config.slot, config.publication))
    try:
        store.prepare()
        first = uuid4()
        store.acquire(first)
        records = mark_all(store, first, 10)
        assert len(records) == 10
        position = slot_position(logical_dsn, log_outbox)
        store.purge([r.id for r in records[:4]])
        assert slot_position(logical_dsn, log_outbox) == position  # the transaction is not done yet
        second = uuid4()
        assert [r.id for r in store.mark(second, 100)] == [r.id for r in records[4:]]
        assert store.mark(second, 100) == []
        store.purge([r.id for r in records[4:]])
        assert wait_until(lambda: slot_position(logical_dsn, log_outbox) != position)
        assert store.mark(uuid4(), 100) == []  # a new pass: nothing left in the slot
    finally:
        store.close()


def test_a_stream_the_server_ended_starts_again_without_repeating_what_was_received(
    logical_dsn: str, log_outbox: TableName
) -> None:
    """The server ends the stream (as its wal_sender_timeout or a restart would): the next mark
    starts another from the slot's position, which skips the transactions already received and
    hands out the new ones."""
    config = HarvesterConfig(outbox_table=log_outbox.qualified)
    insert(logical_dsn, log_outbox, [("t", f"k{i}", f"k{i}:0") for i in range(5)])
    store = log_store(logical_dsn, LogSetup(log_outbox, config.slot, config.publication))
    try:
        store.prepare()
        leader = uuid4()
        store.acquire(leader)
        first = mark_all(store, leader, 5)
        reader = slot_reader(logical_dsn, log_outbox)
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", (reader,))
        insert(logical_dsn, log_outbox, [("t", f"k{i}", f"k{i}:1") for i in range(5)])
        second = mark_all(store, leader, 5)
        assert [r.id for r in second] == [r.id + 5 for r in first]
        assert slot_reader(logical_dsn, log_outbox) not in (None, reader)
        position = slot_position(logical_dsn, log_outbox)
        store.purge([r.id for r in first + second])  # ... and the new stream confirms them
        assert wait_until(lambda: slot_position(logical_dsn, log_outbox) != position)
    finally:
        store.close()


def test_a_transaction_goes_out_only_once_its_rows_are_visible(logical_dsn: str, log_outbox: TableName) -> None:
    """The walsender sends a transaction once its commit record is flushed, a moment before the
    committing session makes it visible. Handed out in that moment, its records could be
    acknowledged and purged before the delete can see their rows: nothing deleted, yet counted
    done, and the slot confirmed past rows left in the table for good (a chaos run lost five
    records so). The stream's transaction is given the xid of one still running, as it would be
    in that moment: nothing goes out until that transaction is visible."""
    config = HarvesterConfig(outbox_table=log_outbox.qualified)
    store = log_store(logical_dsn, LogSetup(log_outbox, config.slot, config.publication))
    try:
        store.prepare()
        leader = uuid4()
        store.acquire(leader)
        insert(logical_dsn, log_outbox, [("t", "k", "k:0")])

        def received() -> bool:
            store._reader.read(1)  # without handing anything out
            return bool(store.txns.kept) and not store.txns.receiving

        assert wait_until(received)
        with psycopg.connect(logical_dsn) as running:
            row = running.execute("SELECT pg_current_xact_id()::text").fetchone()
            assert row is not None
            store.txns.kept[0].xid = int(row[0]) % 2**32
            assert store.mark(leader, 10) == []
            assert store.mark(leader, 10) == []
            # The idle engine's wait ends soon, not after its back-off: nothing more may arrive.
            began = time.monotonic()
            assert store.wait_for_insert(60.0)
            assert time.monotonic() - began < 5.0  # the server's keepalive ends the wait after about 10 s
            running.commit()
        records = mark_all(store, leader, 1)
        assert [r.value for r in records] == [b"k:0"]
        store.purge([r.id for r in records])
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            left = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(log_outbox.ident)).fetchone()
        assert left == (0,)
    finally:
        store.close()


def test_a_connection_lost_while_checking_the_slot_fails_the_start_as_unreachable(
    logical_dsn: str, log_outbox: TableName
) -> None:
    """A restart as the log store checks its slot and publication (after the outbox's own checks):
    the start fails as an unreachable database, which is retried, and the next one succeeds."""
    config = HarvesterConfig(outbox_table=log_outbox.qualified)
    store = log_store(logical_dsn, LogSetup(log_outbox, config.slot, config.publication))
    try:
        PostgresStore.prepare(store)  # the outbox's checks pass; the slot's come next
        with psycopg.connect(logical_dsn, autocommit=True) as admin:
            admin.execute("SELECT pg_terminate_backend(%s, 5000)", (store.db.conn().info.backend_pid,))
        with pytest.raises(StoreUnreachableError, match="57P01"):
            store.prepare()
        store.prepare()
        leader = uuid4()
        store.acquire(leader)
        assert store.mark(leader, 10) == []
    finally:
        store.close()

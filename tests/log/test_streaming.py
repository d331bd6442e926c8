"""Transactions the walsender streams while they are in progress (harvester/postgres/log/streamed.py),
against a real PostgreSQL and Kafka: they go out whole, at their commit, in commit order; what a
rolled-back savepoint or an aborted transaction wrote never goes out; a stream that breaks in the
middle of one loses and repeats nothing. The stream's session sets ``logical_decoding_work_mem`` to
its least, 64 kB, so that transactions of a few hundred rows are streamed; the last test checks the
harvester's own setting, 1 MB, instead."""

from __future__ import annotations

import os
from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from pathlib import Path
from uuid import UUID, uuid4

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harvester import HarvesterConfig, OutboxRecord, Stasher
from harvester.compose import log_store
from harvester.core.records import MarkedRecord
from harvester.postgres.log import pgoutput
from harvester.postgres.log.decoding import TableInserts
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.replication import LogicalStream
from harvester.postgres.log.store import LogStore
from harvester.postgres.log.streamed import StreamedTransactions
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check, insert, wait_drained, wait_until
from tests.log.conftest import SINGLE_SERVER, slot_position, stash
from tests.log.test_log_source import COMMITTED, DELIVERY, at_or_after, lsn, mark_all, slot_reader
from tests.support.harvesters import HarvesterFactory
from tests.support.kafka import read_messages
from tests.support.postgres import streamed_transactions, streaming
from tests.support.services import Services

pytestmark = pytest.mark.integration


def slot_of(table: TableName) -> str:
    """The slot a harvester of ``table`` reads by default."""
    return HarvesterConfig(outbox_table=table.qualified).slot


def leading_store(
    dsn: str, table: TableName, memory: int = 1 << 30, spill_directory: str | None = None, *, small: bool = True
) -> tuple[LogStore, UUID]:
    """A log store over ``table`` whose stream streams transactions of a few hundred rows (see
    :func:`tests.support.postgres.streaming`; with ``small`` false, as its own setting has it),
    leading a term; past ``memory`` (its transactions' records together), a large one's further
    records are spilled (in ``spill_directory``)."""
    config = HarvesterConfig(outbox_table=table.qualified)
    setup = LogSetup(table, config.slot, config.publication)
    store = log_store(
        streaming(dsn) if small else dsn, setup, transaction_memory=memory, spill_directory=spill_directory
    )
    store.prepare()
    leader = uuid4()
    store.acquire(leader)
    return store, leader


def wait_streamed(store: LogStore, leader: UUID, dsn: str, table: TableName, count: int = 1) -> None:
    """Mark (nothing goes out: the open transaction is not committed) until the server has streamed
    ``count`` transactions in progress to ``store``."""
    assert wait_until(lambda: not store.mark(leader, 100) and streamed_transactions(dsn, slot_of(table)) >= count)


def stash_in(conn: psycopg.Connection[object], table: TableName, rows: list[tuple[str, str, str]]) -> None:
    """Write (topic, key, value) rows in ``conn``'s open transaction."""
    Stasher(table).stash(conn, [OutboxRecord(topic=t, key=k, value=v) for t, k, v in rows])


def test_a_streamed_transaction_goes_out_whole_at_its_commit_in_commit_order(
    logical_dsn: str, log_outbox: TableName
) -> None:
    store, leader = leading_store(logical_dsn, log_outbox)
    try:
        with psycopg.connect(logical_dsn) as big:
            stash_in(big, log_outbox, [("t", f"k{i % 10}", f"big:{i}") for i in range(2000)])
            # The server streams it while it is open; nothing of it goes out before its commit.
            wait_streamed(store, leader, logical_dsn, log_outbox)
            insert(logical_dsn, log_outbox, [("t", "k0", "small")])  # commits first: goes out first
            assert [r.value for r in mark_all(store, leader, 1)] == [b"small"]
            big.commit()
        records = mark_all(store, leader, 2000)
        assert [r.value for r in records] == [f"big:{i}".encode() for i in range(2000)]
        assert [r.id for r in records] == sorted(r.id for r in records)
        store.purge([r.id for r in records])  # one statement, committed when it returns
        with psycopg.connect(logical_dsn, autocommit=True) as conn:  # the small one's row: not purged here
            left = conn.execute(sql.SQL("SELECT kafka_value FROM {}").format(log_outbox.ident)).fetchall()
        assert left == [("small",)], left
    finally:
        store.close()


def test_records_decoded_while_their_transaction_streams_match_those_decoded_at_hand_out(
    logical_dsn: str, log_outbox: TableName
) -> None:
    """The log store decodes a streamed transaction's inserts as they come (``_stream_decoder``):
    its records are what the same rows give in transactions too small to stream, which are decoded
    at hand-out, headers and all; a new pass hands out copies, not the records it handed out before."""
    rows = [OutboxRecord.of("t", f"k{i % 7}", f"v:{i}", {"h": str(i)} if i % 2 else {}) for i in range(1000)]
    store, leader = leading_store(logical_dsn, log_outbox)
    try:
        with psycopg.connect(logical_dsn) as conn:
            Stasher(log_outbox).stash(conn, rows)
            wait_streamed(store, leader, logical_dsn, log_outbox)
        streamed = mark_all(store, leader, 1000)
        kept = [m for txn in store.txns.kept for m in txn.inserts]
        assert len(kept) == 1000 and not any(isinstance(m, bytes) for m in kept)  # decoded as they came
        for i in range(0, 1000, 10):
            with psycopg.connect(logical_dsn) as conn:
                Stasher(log_outbox).stash(conn, rows[i : i + 10])
        whole = mark_all(store, leader, 1000)
        assert all(isinstance(m, bytes) for txn in list(store.txns.kept)[1:] for m in txn.inserts)

        def content(records: list[MarkedRecord]) -> list[tuple[object, ...]]:
            return [(r.topic, r.key, r.value, r.headers, r.malformed, r.stamp) for r in records]

        assert content(streamed) == content(whole)
        assert [r.value for r in streamed] == [f"v:{i}".encode() for i in range(1000)]
        again = mark_all(store, uuid4(), 2000)[:1000]  # a new pass, the first still in flight
        assert [r.id for r in again] == [r.id for r in streamed]
        assert content(again) == content(streamed)
        assert not any(a is b for a, b in zip(again, streamed, strict=True))
    finally:
        store.close()


def test_a_transaction_past_the_memory_limit_is_spilled_and_every_pass_reads_it_back(
    logical_dsn: str, log_outbox: TableName
) -> None:
    """A streamed transaction outgrows the store's memory for transactions (100 kB: about 150 of
    its records): the rest waits in a spill file as it came, a rolled-back savepoint's rows are cut
    from it, and its records go out whole and in order, decoded at hand-out; a new pass reads them
    back again; once they are all done the slot moves past them and the file is removed."""
    store, leader = leading_store(logical_dsn, log_outbox, memory=100_000)
    try:
        with psycopg.connect(logical_dsn) as conn:
            stash_in(conn, log_outbox, [("t", f"k{i % 7}", f"kept:{i}") for i in range(1500)])
            conn.execute("SAVEPOINT s")
            stash_in(conn, log_outbox, [("t", "k", f"rolled-back:{i}") for i in range(500)])
            wait_streamed(store, leader, logical_dsn, log_outbox)
            conn.execute("ROLLBACK TO SAVEPOINT s")
            stash_in(conn, log_outbox, [("t", f"k{i % 7}", f"kept:{i}") for i in range(1500, 2000)])
        records = mark_all(store, leader, 2000)
        expected = [f"kept:{i}".encode() for i in range(2000)]
        assert [r.value for r in records] == expected
        # Other transactions of the database may come too, streamed and empty (PostgreSQL skips empty
        # transactions only when they were not streamed): the test's transaction is the one with records.
        (txn,) = [t for t in store.txns.kept if t.size]
        spill = txn.spill
        assert spill is not None and len(spill) > 1500 and len(txn.inserts) < 500
        again = mark_all(store, uuid4(), 2000)
        assert [r.value for r in again] == expected and [r.id for r in again] == [r.id for r in records]
        position = slot_position(logical_dsn, log_outbox)
        store.purge([r.id for r in again])
        assert wait_until(lambda: slot_position(logical_dsn, log_outbox) != position)
        assert not store.txns.kept
        with pytest.raises(ValueError, match="closed file"):
            spill.read(0, 1)
        assert wait_drained(logical_dsn, log_outbox) == 0
    finally:
        store.close()


def test_a_large_transaction_spills_into_the_spill_directory(
    logical_dsn: str, log_outbox: TableName, tmp_path: Path
) -> None:
    """logSpillDirectory: the file a transaction past the memory limit spills to is made there (unnamed,
    so the directory lists nothing: the descriptor's link names it), and the transaction drains whole."""
    store, leader = leading_store(logical_dsn, log_outbox, memory=100_000, spill_directory=str(tmp_path))
    try:
        with psycopg.connect(logical_dsn) as conn:
            stash_in(conn, log_outbox, [("t", f"k{i % 7}", f"v:{i}") for i in range(1500)])
        records = mark_all(store, leader, 1500)
        assert [r.value for r in records] == [f"v:{i}".encode() for i in range(1500)]
        (txn,) = [t for t in store.txns.kept if t.size]
        assert txn.spill is not None and len(txn.spill) > 1000
        assert os.readlink(f"/proc/self/fd/{txn.spill._file.fileno()}").startswith(f"{tmp_path}/")
        assert not list(tmp_path.iterdir())
        store.purge([r.id for r in records])
        assert wait_drained(logical_dsn, log_outbox) == 0
    finally:
        store.close()


def test_large_transactions_at_once_share_the_memory_limit(logical_dsn: str, log_outbox: TableName) -> None:
    """Two transactions written at once, each under the store's memory for transactions (300 kB:
    about 350 records of these) but not together: what outgrows the sum spills; both go out
    whole, in commit order, and once they are done nothing is counted and no file is left."""
    store, leader = leading_store(logical_dsn, log_outbox, memory=300_000)
    pad = "x" * 200
    try:
        with psycopg.connect(logical_dsn) as a, psycopg.connect(logical_dsn) as b:
            for i in range(0, 250, 50):
                stash_in(a, log_outbox, [("t", f"k{j % 7}", f"a:{j}:{pad}") for j in range(i, i + 50)])
                stash_in(b, log_outbox, [("t", f"k{j % 7}", f"b:{j}:{pad}") for j in range(i, i + 50)])
            wait_streamed(store, leader, logical_dsn, log_outbox, count=2)
            b.commit()
            a.commit()
        records = mark_all(store, leader, 500)
        expected = [f"{t}:{j}:{pad}".encode() for t in "ba" for j in range(250)]
        assert [r.value for r in records] == expected
        txns = [t for t in store.txns.kept if t.size]  # not others' streamed empty ones
        assert [t.size for t in txns] == [250, 250]
        spills = [t.spill for t in txns if t.spill is not None]  # one, or both if they streamed in turns
        assert spills and all(0 < len(spill) < 250 for spill in spills)
        position = slot_position(logical_dsn, log_outbox)
        store.purge([r.id for r in records])
        assert wait_until(lambda: slot_position(logical_dsn, log_outbox) != position)
        assert (store._budget.received, store._budget.streamed, store._budget.handed) == (0, 0, 0)
        with pytest.raises(ValueError, match="closed file"):
            spills[0].read(0, 1)
    finally:
        store.close()


def test_what_a_rolled_back_savepoint_or_an_aborted_transaction_streamed_never_goes_out(
    logical_dsn: str, log_outbox: TableName
) -> None:
    store, leader = leading_store(logical_dsn, log_outbox)
    try:
        with psycopg.connect(logical_dsn) as conn:
            stash_in(conn, log_outbox, [("t", "k", f"kept:{i}") for i in range(1000)])
            conn.execute("SAVEPOINT s")
            stash_in(conn, log_outbox, [("t", "k", f"rolled-back:{i}") for i in range(1000)])
            wait_streamed(store, leader, logical_dsn, log_outbox)
            conn.execute("ROLLBACK TO SAVEPOINT s")
            stash_in(conn, log_outbox, [("t", "k", f"kept:{i}") for i in range(1000, 1500)])
        records = mark_all(store, leader, 1500)
        assert [r.value for r in records] == [f"kept:{i}".encode() for i in range(1500)]
        with psycopg.connect(logical_dsn) as conn:
            stash_in(conn, log_outbox, [("t", "k", f"aborted:{i}") for i in range(1000)])
            wait_streamed(store, leader, logical_dsn, log_outbox, 2)
            conn.rollback()
        insert(logical_dsn, log_outbox, [("t", "k", "last")])
        assert [r.value for r in mark_all(store, leader, 1)] == [b"last"]
        assert store.mark(leader, 100) == []
    finally:
        store.close()


def test_a_stream_broken_while_a_transaction_streams_loses_and_repeats_nothing(
    logical_dsn: str, log_outbox: TableName
) -> None:
    """The stream ends while a transaction is half streamed, after the idle leader confirmed a
    position past the transaction's start (nothing it received was done but that one's part): the
    next stream sends the transaction again from its start (the slot keeps what a transaction not
    ended yet needs), and the half received before is dropped with the old stream."""
    store, leader = leading_store(logical_dsn, log_outbox)
    try:
        with psycopg.connect(logical_dsn) as conn:
            began = lsn(logical_dsn)
            stash_in(conn, log_outbox, [("t", f"k{i % 3}", f"v:{i}") for i in range(1500)])
            wait_streamed(store, leader, logical_dsn, log_outbox)
            store._finish.advance_to(pgoutput.lsn_value(lsn(logical_dsn)))  # as an idle leader's confirmation may

            def confirmed() -> bool:
                # The walsender takes the confirmation in when it next reads its socket; marks keep the
                # stream read (nothing goes out: the transaction is open), and a stream that broke
                # meanwhile is started again, reporting the confirmation as it starts.
                assert store.mark(leader, 100) == []
                return not at_or_after(logical_dsn, began, slot_position(logical_dsn, log_outbox))

            assert wait_until(confirmed), (began, slot_position(logical_dsn, log_outbox), store.slot.streaming)
            reader = slot_reader(logical_dsn, log_outbox)
            with psycopg.connect(logical_dsn, autocommit=True) as admin:
                admin.execute("SELECT pg_terminate_backend(%s, 5000)", (reader,))
            stash_in(conn, log_outbox, [("t", f"k{i % 3}", f"v:{i}") for i in range(1500, 2000)])
        records = mark_all(store, leader, 2000)
        assert [r.value for r in records] == [f"v:{i}".encode() for i in range(2000)]
        assert slot_reader(logical_dsn, log_outbox) not in (None, reader)
        assert store.mark(leader, 100) == []
    finally:
        store.close()


def test_a_table_less_outbox_s_streamed_messages_go_out_whole(logical_dsn: str, message_outbox: TableName) -> None:
    config = HarvesterConfig(outbox_table=message_outbox.qualified, source="log", log_messages=True, **SINGLE_SERVER)
    setup = LogSetup(message_outbox, config.slot, config.publication, config.prefix, config.log_accept_loss_on_failover)
    store = log_store(streaming(logical_dsn), setup)
    try:
        store.prepare()
        leader = uuid4()
        store.acquire(leader)
        stash(logical_dsn, message_outbox, [("t", f"k{i % 10}", f"m:{i}") for i in range(2000)])
        records = mark_all(store, leader, 2000)
        assert [r.value for r in records] == [f"m:{i}".encode() for i in range(2000)]
        assert streamed_transactions(logical_dsn, slot_of(message_outbox)) > 0
        # Decoded as they came, given their transaction's commit time at hand-out.
        assert not any(isinstance(m, bytes) for txn in store.txns.kept for m in txn.inserts)
        (committed,) = {txn.commit_time for txn in store.txns.kept if txn.size}  # not others' streamed empty ones
        commit_time = datetime(2000, 1, 1, tzinfo=UTC) + timedelta(microseconds=committed)
        assert {r.create_time for r in records} == {commit_time}
    finally:
        store.close()


@DELIVERY
def test_streamed_and_whole_transactions_drain_in_order_in_both_modes(
    services: Services,
    logical_dsn: str,
    log_outbox: TableName,
    topics: Callable[..., str],
    make_log_harvester: HarvesterFactory,
    delivery: str,
) -> None:
    """Large transactions (streamed, and spilled past the memory for one) between small ones, each
    key's values in order across them."""
    topic = topics(partitions=3)
    # A transaction's records past 100 kB (about 150) wait in a spill file.
    make_log_harvester(delivery=delivery, dsn=streaming(logical_dsn), memory=100_000)
    sizes = [1500, 10, 1500, 10, 10, 1500]
    written = {f"k{k}": 0 for k in range(5)}
    for size in sizes:
        rows = []
        for i in range(size):
            key = f"k{i % 5}"
            rows.append((topic, key, f"{key}:{written[key]}"))
            written[key] += 1
        insert(logical_dsn, log_outbox, rows)
    total = sum(sizes)
    messages = read_messages(services.bootstrap, [topic], total, **COMMITTED)
    verdict = check(messages, written)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    if delivery == "exactly_once":
        assert verdict.duplicates == 0
    assert wait_drained(logical_dsn, log_outbox) == 0
    assert streamed_transactions(logical_dsn, slot_of(log_outbox)) >= 3


def test_inserts_taken_natively_from_the_copy_data_are_what_the_python_path_keeps(
    logical_dsn: str, log_outbox: TableName, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The usual inserts of a streamed transaction are taken straight from the stream's copy data by
    the C decoder (``StreamedTransactions.take_inserts``), the rest one by one (rows with headers, a
    subtransaction's first, the Relation): the stream gives what it gives without the C decoder."""
    rows = [
        OutboxRecord.of("t", f"k{i % 7}", f"v:{i}" if i % 5 else None, {"h": "1"} if i % 9 == 0 else {})
        for i in range(900)
    ]
    with psycopg.connect(logical_dsn) as conn:
        Stasher(log_outbox).stash(conn, rows[:300])
        conn.execute("SAVEPOINT part")
        Stasher(log_outbox).stash(conn, rows[300:600])
        conn.execute("RELEASE SAVEPOINT part")
        Stasher(log_outbox).stash(conn, rows[600:])
    config = HarvesterConfig(outbox_table=log_outbox.qualified)
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        found = conn.execute("SELECT %s::regclass::oid", (log_outbox.quoted,)).fetchone()
    assert found is not None
    oid, position = int(found[0]), pgoutput.lsn_value(slot_position(logical_dsn, log_outbox))
    natively: list[int] = []
    take_inserts = StreamedTransactions.take_inserts

    def counted(self: StreamedTransactions, raw: list[bytes | memoryview], start: int, head: int) -> int:
        end = take_inserts(self, raw, start, head)
        natively.append(end - start)
        return end

    monkeypatch.setattr(StreamedTransactions, "take_inserts", counted)

    def given() -> list[object]:
        """The records and Relation messages a new stream gives (the slot is never confirmed), to the
        transaction's Commit."""
        stream = LogicalStream(
            streaming(logical_dsn),
            config.slot,
            config.publication,
            position,
            decoder=lambda: TableInserts().stream_decoder(oid),
        )
        out: list[object] = []

        def committed() -> bool:
            out.extend(stream.read(5000))
            records = sum(isinstance(m, MarkedRecord) for m in out)
            return records == 900 and isinstance(out[-1], bytes) and out[-1][:1] == b"C"

        try:
            assert wait_until(committed)
        finally:
            stream.close()
        return [m for m in out if not isinstance(m, bytes) or m[:1] == b"R"]

    native = given()
    monkeypatch.setenv("HARVESTER_INSERT_DECODER", "python")
    taken, natively[:] = sum(natively), []
    python = given()
    assert sum(natively) == 0 and taken >= 700  # the usual rows of the three parts, but a first of each
    assert native == python


@pytest.mark.parametrize(("options", "streamed"), [("", True), ("-c logical_decoding_work_mem=64MB", False)])
def test_the_stream_decodes_in_1_mb_steps_unless_the_dsn_chooses(
    logical_dsn: str, log_outbox: TableName, options: str, streamed: bool
) -> None:
    """The stream's session has the server stream a transaction of more than 1 MB of changes while it
    is in progress (``store.DECODING_OPTIONS``); options of the DSN's own choose otherwise."""
    dsn = make_conninfo(logical_dsn, options=options) if options else logical_dsn
    store, leader = leading_store(dsn, log_outbox, small=False)
    slot = slot_of(log_outbox)
    try:
        before = streamed_transactions(logical_dsn, slot)
        insert(logical_dsn, log_outbox, [("t", f"k{i % 10}", f"{i}:" + "x" * 400) for i in range(5000)])  # ~2.5 MB
        assert len(mark_all(store, leader, 5000)) == 5000
        if streamed:
            assert wait_until(lambda: streamed_transactions(logical_dsn, slot) > before, timeout=10)
        else:
            assert streamed_transactions(logical_dsn, slot) == before
    finally:
        store.close()

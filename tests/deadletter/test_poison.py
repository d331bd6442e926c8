"""Poison records are dead-lettered after the configured attempts; nothing else stalls or is lost."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable
from datetime import UTC, datetime

import psycopg
import pytest
from psycopg import sql

from harvester.postgres.schema import deadletter
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table
from tests.engine.workload import check, insert, wait_drained, wait_until
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.harvesters import HarvesterFactory
from tests.support.kafka import create_topics, delete_topics, read_messages, set_topic_config
from tests.support.names import unique
from tests.support.private_services import PrivateKafka
from tests.support.services import Services

pytestmark = pytest.mark.integration

FAST = {
    "message.timeout.ms": 2000,
    "topic.metadata.propagation.max.ms": 1000,
    "topic.metadata.refresh.interval.ms": 500,
}


def raw_insert(dsn: str, table: TableName, rows: list[tuple[object, ...]]) -> list[int]:
    """Insert rows as any application could (plain SQL, no validation): (topic, key, value, hkeys, hvalues)."""
    statement = sql.SQL(
        "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys,"
        " kafka_header_values) VALUES (now(), %s, %s, %s, %s, %s) RETURNING id"
    ).format(table.ident)
    ids: list[int] = []
    with psycopg.connect(dsn) as conn:
        for row in rows:
            inserted = conn.execute(statement, row).fetchone()
            assert inserted is not None
            ids.append(int(inserted[0]))
    return ids


def dead_letters(dsn: str, table: TableName) -> dict[int, tuple[str, int]]:
    with psycopg.connect(dsn) as conn:
        return {
            int(r[0]): (str(r[1]), int(r[2]))
            for r in conn.execute(
                sql.SQL("SELECT id, reason, attempts FROM {}").format(dead_letter_table(table).ident)
            ).fetchall()
        }


def test_each_poison_kind_is_dead_lettered_while_good_records_flow(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    outbox: TableName,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
) -> None:
    pg.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN kafka_key DROP NOT NULL").format(outbox.ident))
    good, small, missing = topics(), topics(**{"max.message.bytes": "1024"}), unique("missing")
    big = "p1:0:" + os.urandom(4500).hex()
    poison = raw_insert(
        services.pg_dsn,
        outbox,
        [
            (small, "p1", big, [], []),  # larger than the topic accepts
            ("bad topic!", "p2", "p2:0", [], []),  # a name Kafka rejects
            (missing, "p3", "p3:0", [], []),  # a topic that does not exist (auto-create off)
            (good, "p4", "p4:0", ["a", "b"], ["1"]),  # header arrays of different lengths
            (good, None, "null-key", [], []),  # NULL key
        ],
    )
    # Followers on the poisoned keys (same topic as their poison where it exists) and other keys.
    followers = [(small, "p1", "p1:1"), (good, "p2", "p2:1"), (good, "p4", "p4:1")]
    insert(services.pg_dsn, outbox, followers + [(good, f"g{i % 20}", f"g{i % 20}:{i // 20}") for i in range(200)])
    h = make_harvester(producer=FAST, max_attempts=2, retry_backoff="10ms", max_retry_backoff="50ms")
    assert wait_drained(services.pg_dsn, outbox, timeout=90) == 0
    letters = dead_letters(services.pg_dsn, outbox)
    assert set(letters) == set(poison)
    assert all(attempts == 2 for _, attempts in letters.values()), letters
    reasons = [letters[i][0] for i in poison]
    assert reasons[0] == "msg_size_too_large" and reasons[3] == "malformed" and reasons[4] == "malformed"
    got = read_messages(services.bootstrap, [good, small], 203)
    expected = {f"g{i}": 10 for i in range(20)}
    verdict = check([m for m in got if (m.key() or b"").startswith(b"g")], expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0
    assert sorted((m.value() or b"").decode() for m in got if not (m.key() or b"").startswith(b"g")) == [
        "p1:1",
        "p2:1",
        "p4:1",
    ]
    assert h.metrics.dead_lettered.labels("malformed")._value.get() == 2

    # Replay: once the cause is fixed, the record goes back into the outbox and is delivered once.
    create_topics(services.bootstrap, [missing])
    time.sleep(1.5)  # the producer learns of the new topic at its next metadata refresh
    try:
        with psycopg.connect(services.pg_dsn) as conn:
            new_ids = deadletter.replay(conn, outbox, [poison[2]])
        assert len(new_ids) == 1 and new_ids[0] > poison[2]
        assert wait_drained(services.pg_dsn, outbox) == 0
        assert [m.value() for m in read_messages(services.bootstrap, [missing], 1)] == [b"p3:0"]
        assert poison[2] not in dead_letters(services.pg_dsn, outbox)
    finally:
        delete_topics(services.bootstrap, [missing])
    with psycopg.connect(services.pg_dsn) as conn:
        assert deadletter.purge(conn, outbox, datetime.now(UTC)) == 4


def test_broker_outage_dead_letters_nothing(
    services: Services, outbox: TableName, private_kafka: PrivateKafka, make_harvester: HarvesterFactory
) -> None:
    topic = unique("outage")
    create_topics(private_kafka.bootstrap, [topic])
    h = make_harvester(
        bootstrap=private_kafka.bootstrap, producer=FAST, max_attempts=1, retry_backoff="50ms", max_retry_backoff="1s"
    )
    private_kafka.stop()
    try:
        insert(services.pg_dsn, outbox, [(topic, f"k{i % 5}", f"k{i % 5}:{i // 5}") for i in range(50)])
        assert wait_until(lambda: h.metrics.retries.labels("retriable")._value.get() >= 3, timeout=60)
    finally:
        private_kafka.start()
    assert wait_drained(services.pg_dsn, outbox, timeout=120) == 0
    assert dead_letters(services.pg_dsn, outbox) == {}
    verdict = check(read_messages(private_kafka.bootstrap, [topic], 50), {f"k{i}": 10 for i in range(5)})
    assert verdict.lost == [] and verdict.out_of_order == []


def test_attempt_counts_survive_sigkill_failover(services: Services, outbox: TableName) -> None:
    """The first leader retries a poison record (it never gives up) and is killed; the second one,
    with max_attempts=4, continues from the stored count: it dead-letters the record at its first
    own failure, with the count one above what the killed leader left behind."""
    missing = unique("missing")
    [poison] = raw_insert(services.pg_dsn, outbox, [(missing, "p", "p:0", [], [])])
    group = unique("attempts")

    def spec(name: str, max_attempts: int) -> dict[str, object]:
        return harvester_spec(
            services.pg_dsn,
            services.bootstrap,
            outbox,
            group,
            name,
            producer_kafka_config=FAST,
            limits={"max_attempts": max_attempts, "retry_backoff": "10ms"},
        )

    def attempts() -> int:
        with psycopg.connect(services.pg_dsn) as conn:
            row = conn.execute(
                sql.SQL("SELECT harvest_attempts FROM {} WHERE id = %s").format(outbox.ident), (poison,)
            ).fetchone()
        return int(row[0]) if row else -1

    a = HarvesterProcess(spec("first", 1_000_000))
    b: HarvesterProcess | None = None
    try:
        assert a.wait_for("LeaderAcquired"), a.log
        b = HarvesterProcess(spec("second", 4))
        assert b.wait_for("started"), b.log
        assert wait_until(lambda: attempts() >= 4, timeout=60), (attempts(), a.log[-20:])
        os.kill(a.proc.pid, signal.SIGKILL)
        killed_at = datetime.now(UTC)
        time.sleep(0.5)  # a statement of the killed leader's may still be committing
        left_behind = attempts()
        assert b.wait_for("LeaderAcquired", timeout=30), b.log
        assert wait_until(lambda: poison in dead_letters(services.pg_dsn, outbox), timeout=60)
    finally:
        a.terminate()
        if b is not None:
            b.terminate()
        delete_topics(services.bootstrap, [f"{group}.neli"])
    with psycopg.connect(services.pg_dsn) as conn:
        row = conn.execute(
            sql.SQL("SELECT attempts, first_failure FROM {} WHERE id = %s").format(dead_letter_table(outbox).ident),
            (poison,),
        ).fetchone()
    assert row is not None
    # In-memory counting would have started again at 1 and given up only at 4.
    assert row[0] == left_behind + 1 and row[1] < killed_at


def test_hold_key_policy_keeps_the_key_until_replay(
    services: Services, outbox: TableName, topics: Callable[..., str], make_harvester: HarvesterFactory
) -> None:
    good, small = topics(), topics(**{"max.message.bytes": "1024"})
    big = "h:1:" + os.urandom(4500).hex()
    insert(services.pg_dsn, outbox, [(small, "h", "h:0"), (small, "h", big), (small, "h", "h:2"), (small, "h", "h:3")])
    insert(services.pg_dsn, outbox, [(good, f"g{i % 5}", f"g{i % 5}:{i // 5}") for i in range(50)])
    make_harvester(settings={"dead_letter_policy": "hold_key"}, max_attempts=2, retry_backoff="10ms")
    assert len(read_messages(services.bootstrap, [good], 50)) == 50  # other keys flow
    assert wait_until(lambda: len(dead_letters(services.pg_dsn, outbox)) == 1)
    time.sleep(1.0)
    with psycopg.connect(services.pg_dsn) as conn:
        held = conn.execute(sql.SQL("SELECT kafka_value FROM {} ORDER BY id").format(outbox.ident)).fetchall()
    assert [r[0] for r in held] == ["h:2", "h:3"]  # held back, not published
    assert [m.value() for m in read_messages(services.bootstrap, [small], 1, timeout=5)] == [b"h:0"]
    set_topic_config(services.bootstrap, small, "max.message.bytes", "1048576")
    with psycopg.connect(services.pg_dsn) as conn:
        deadletter.replay(conn, outbox, None, held_keys=True)
    assert wait_drained(services.pg_dsn, outbox) == 0
    verdict = check(read_messages(services.bootstrap, [small], 4), {"h": 4})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0

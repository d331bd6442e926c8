"""Delivery failures, a dropped database connection and a broker restart lose and reorder nothing."""

from __future__ import annotations

import os
from collections.abc import Callable

import psycopg
import pytest
from confluent_kafka.admin import AdminClient

from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check, insert, wait_drained, wait_until, write_concurrently, writing
from tests.support.harvesters import HarvesterFactory
from tests.support.kafka import create_topics, read_messages, set_topic_config
from tests.support.names import unique
from tests.support.private_services import PrivateKafka
from tests.support.services import Services

pytestmark = pytest.mark.integration

FAST_FAIL = {"message.timeout.ms": 2000, "topic.metadata.propagation.max.ms": 1000}


def test_missing_topic_resets_and_remarks_until_it_exists(
    services: Services, outbox: TableName, topics: Callable[..., str], make_harvester: HarvesterFactory
) -> None:
    missing, good = unique("missing"), topics()
    rows = [(missing, "a", f"a:{i}") for i in range(3)] + [
        (good, f"b{i % 10}", f"b{i % 10}:{i // 10}") for i in range(50)
    ]
    insert(services.pg_dsn, outbox, rows)
    h = make_harvester(producer=FAST_FAIL, max_attempts=1000, max_retry_backoff="200ms")  # retry, never dead-letter
    # Other keys flow while key "a" keeps failing: all of "good" arrives before "missing" exists.
    assert len(read_messages(services.bootstrap, [good], 50)) == 50
    assert wait_until(lambda: h.metrics.reset._value.get() >= 2)
    create_topics(services.bootstrap, [missing])
    try:
        assert wait_drained(services.pg_dsn, outbox) == 0
        verdict = check(read_messages(services.bootstrap, [missing], 3), {"a": 3})
        assert verdict.lost == [] and verdict.out_of_order == []
    finally:
        AdminClient({"bootstrap.servers": services.bootstrap}).delete_topics([missing])


def test_record_too_large_for_topic_holds_its_key_until_accepted(
    services: Services, outbox: TableName, topics: Callable[..., str], make_harvester: HarvesterFactory
) -> None:
    small = topics(**{"max.message.bytes": "1024"})
    big_value = "c:1:" + os.urandom(4500).hex()  # incompressible, so lz4 cannot shrink it under the limit
    insert(services.pg_dsn, outbox, [(small, "c", "c:0"), (small, "c", big_value), (small, "c", "c:2")])
    h = make_harvester(max_attempts=1000)  # retry, never dead-letter
    assert wait_until(lambda: h.metrics.reset._value.get() >= 2)
    # The key's later record must not overtake the failing one.
    early = read_messages(services.bootstrap, [small], 1, timeout=5)
    assert [m.value() for m in early] == [b"c:0"]
    set_topic_config(services.bootstrap, small, "max.message.bytes", "1048576")
    assert wait_drained(services.pg_dsn, outbox) == 0
    verdict = check(read_messages(services.bootstrap, [small], 3), {"c": 3})
    assert verdict.lost == [] and verdict.out_of_order == []


def test_busy_key_does_not_stall_other_keys(
    services: Services, outbox: TableName, topics: Callable[..., str], make_harvester: HarvesterFactory
) -> None:
    """Key "slow" has a record stuck in flight (its topic does not exist yet) and more queued behind
    it; every record of the other keys, on the same kind of mark batches, is delivered meanwhile."""
    missing, good = unique("missing"), topics()
    rows = [(missing, "slow", "slow:0"), (missing, "slow", "slow:1")]
    rows += [(good, f"k{i % 100}", f"k{i % 100}:{i // 100}") for i in range(500)]
    insert(services.pg_dsn, outbox, rows)
    h = make_harvester(
        producer={"message.timeout.ms": 60000, "topic.metadata.propagation.max.ms": 60000}, max_attempts=1000
    )
    got = read_messages(services.bootstrap, [good], 500)
    assert len(got) == 500
    assert h.in_flight_records == 1 and h.in_flight_keys == 1  # "slow" is still in flight
    assert h.queued_records == 1  # its successor waits behind it
    verdict = check(got, {f"k{i}": 5 for i in range(100)})
    assert verdict.lost == [] and verdict.out_of_order == []


def test_database_connections_killed_mid_run(
    services: Services, outbox: TableName, topics: Callable[..., str], make_harvester: HarvesterFactory
) -> None:
    topic = topics(partitions=2)
    expected = write_concurrently(services.pg_dsn, outbox, topic, keys=50, per_key=60, writers=4)
    # A name of its own, so that only this harvester's connections are killed, not those of tests
    # running beside it on the same server.
    name = unique("doomed")
    h = make_harvester(mark_query_records=20, max_in_flight_records=50, settings={"name": name})
    terminated = 0

    def purged(least: int) -> Callable[[], bool]:
        return lambda: h.metrics.purged._value.get() >= least

    with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
        for kill in range(1, 6):
            # Each kill lands on a harvester at work: it purged more since the previous one.
            assert wait_until(purged(kill * 200))
            row = conn.execute(
                "SELECT count(*) FILTER (WHERE pg_terminate_backend(pid)) FROM pg_stat_activity"
                " WHERE application_name = %s",
                (f"outbox-harvester {name}"[:63],),
            ).fetchone()
            terminated += int(row[0]) if row else 0
    assert terminated >= 5  # its connections, every time
    assert wait_drained(services.pg_dsn, outbox) == 0
    verdict = check(read_messages(services.bootstrap, [topic], 3000), expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0


def test_broker_restart_mid_run(
    services: Services, outbox: TableName, private_kafka: PrivateKafka, make_harvester: HarvesterFactory
) -> None:
    topic = unique("restart")
    create_topics(private_kafka.bootstrap, [topic], partitions=2)
    h = make_harvester(bootstrap=private_kafka.bootstrap, mark_query_records=20, max_in_flight_records=20)
    writer = writing(services.pg_dsn, outbox, topic, keys=40, per_key=50, writers=4, per_txn=2)
    assert wait_until(lambda: h.metrics.purged._value.get() >= 100)  # the restart lands on a harvester at work
    private_kafka.restart()
    writer.join()
    assert wait_drained(services.pg_dsn, outbox, timeout=120) == 0
    expected = {f"k{i}": 50 for i in range(40)}
    verdict = check(read_messages(private_kafka.bootstrap, [topic], 2000), expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0


def test_a_dead_marking_thread_makes_the_harvester_not_alive(
    services: Services,
    outbox: TableName,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    topic = topics()
    h = make_harvester()
    insert(services.pg_dsn, outbox, [(topic, "k", "k:0")])
    assert wait_drained(services.pg_dsn, outbox) == 0
    assert h.alive

    def bug(*_: object) -> None:
        raise RuntimeError("a bug, not a database error")

    # Not a StoreError: nothing retries it, the thread ends, and only a restart would help.
    monkeypatch.setattr(h._pipelines[0].store, "mark", bug)
    insert(services.pg_dsn, outbox, [(topic, "k", "k:1")])
    assert wait_until(lambda: not h.alive)
    h.stop()
    assert h.alive  # a stopped harvester is not a dead one

"""Throttle on real services, idle efficiency with LISTEN/NOTIFY, and BYTEA/TEXT/JSONB value columns."""

from __future__ import annotations

import json
import threading
import time
from collections.abc import Callable, Sequence

import psycopg
import pytest
from psycopg import sql

from harvester import Engine, Harvester, Limits, OutboxRecord, PostgresStore, Stasher
from harvester.core.at_least_once import at_least_once
from harvester.core.identity import Identity
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import DeliveryCallback, DeliveryReport
from harvester.core.records import MarkedRecord
from harvester.kafka.publisher import KafkaPublisher, producer_config
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check, insert, wait_drained, wait_until, write_concurrently
from tests.support.harvesters import HarvesterFactory, ManualElector
from tests.support.kafka import consumed_headers, read_messages
from tests.support.services import Services

pytestmark = pytest.mark.integration


class CountingPublisher(KafkaPublisher):
    """Counts records handed to Kafka and not yet reported, at every publish."""

    def __init__(self, config: dict[str, object], callback: DeliveryCallback) -> None:
        self.outstanding = 0
        self.peak = 0
        self.lock = threading.Lock()

        def counted(report: DeliveryReport) -> None:
            with self.lock:
                self.outstanding -= 1
            callback(report)

        super().__init__(config, counted)

    def publish(self, records: Sequence[MarkedRecord]) -> None:
        with self.lock:
            self.outstanding += len(records)
            self.peak = max(self.peak, self.outstanding)
        super().publish(records)


def test_throttle_bound_never_exceeded_on_real_services(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    topic = topics(partitions=3)
    expected = write_concurrently(services.pg_dsn, outbox, topic, keys=500, per_key=4, writers=4)
    made: list[CountingPublisher] = []

    def factory(cb: DeliveryCallback) -> CountingPublisher:
        made.append(CountingPublisher(producer_config({"bootstrap.servers": services.bootstrap}, {}), cb))
        return made[0]

    store = PostgresStore.open(services.pg_dsn, outbox)
    engine = Engine(
        store, at_least_once(store, factory), Limits(max_in_flight_records=25), HarvesterMetrics(), lambda e: None
    )
    engine.start()
    ManualElector().start(engine.on_leader_event)
    try:
        assert wait_drained(services.pg_dsn, outbox) == 0
    finally:
        engine.stop_marking()
        engine.close(5)
        store.close()
    assert 1 < made[0].peak <= 25
    verdict = check(read_messages(services.bootstrap, [topic], 2000), expected)
    assert verdict.lost == [] and verdict.out_of_order == []


def test_idle_harvester_polls_rarely_and_wakes_on_notify(
    services: Services, outbox: TableName, topics: Callable[..., str], make_harvester: HarvesterFactory
) -> None:
    topic = topics()
    h = make_harvester(max_mark_backoff="30s")
    # Settle into idle back-off from its first mark, not from the start: winning the leadership takes
    # a while on a loaded machine, and the back-off's first steps (10 ms doubling) come after it.
    assert wait_until(lambda: _count(h) > 0, timeout=30)
    time.sleep(1.5)
    before = _count(h)
    time.sleep(3.0)
    idle_marks = _count(h) - before
    # Back-off doubles from 10 ms to 30 s: an idle harvester marks a handful of times, not per poll.
    assert idle_marks <= 3
    # With a 30 s back-off the record can only arrive quickly because the trigger's NOTIFY woke us.
    sent = time.monotonic()
    insert(services.pg_dsn, outbox, [(topic, "k", "k:0")])
    got = read_messages(services.bootstrap, [topic], 1, timeout=10)
    assert len(got) == 1 and time.monotonic() - sent < 10


def _count(h: Harvester) -> float:
    """How many mark queries ``h`` has run."""
    for metric in h.registry.collect():
        if metric.name == "harvester_mark_query_seconds":
            for s in metric.samples:
                if s.name.endswith("_count"):
                    return float(s.value)
    return 0.0


@pytest.mark.parametrize("value_type", ["BYTEA", "TEXT", "JSONB"])
def test_value_column_types(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
    value_type: str,
) -> None:
    table = TableName(schema, "outbox")
    pg.execute(
        sql.SQL(
            "ALTER TABLE {} ALTER COLUMN kafka_value TYPE " + value_type + " USING kafka_value::" + value_type.lower()
        ).format(table.ident)
    )
    topic = topics()
    payload: str | bytes
    if value_type == "BYTEA":
        payload = bytes(range(256))
    elif value_type == "JSONB":
        payload = json.dumps({"n": 1, "s": "ü"})
    else:
        payload = "plain ü text"
    with psycopg.connect(services.pg_dsn) as conn:
        Stasher(table).stash(
            conn, [OutboxRecord.of(topic, "k", payload, {"h": "1"}), OutboxRecord.of(topic, "k", None)]
        )
    make_harvester()
    got = read_messages(services.bootstrap, [topic], 2)
    assert len(got) == 2
    first, tombstone = got
    if value_type == "JSONB":
        value = first.value()
        assert value is not None
        assert json.loads(value) == json.loads(payload)
    else:
        assert first.value() == (payload if isinstance(payload, bytes) else payload.encode())
    headers = consumed_headers(first) or []
    assert headers[0] == ("h", b"1")  # the row's own headers come first, unchanged
    identity = Identity.from_headers(headers)
    assert identity is not None and identity.epoch >= 1 and identity.producer.endswith(f"/{schema}.outbox")
    assert tombstone.value() is None


def test_outbox_left_intact_when_harvester_is_not_leader(
    services: Services, outbox: TableName, topics: Callable[..., str], make_harvester: HarvesterFactory
) -> None:
    topic = topics()
    insert(services.pg_dsn, outbox, [(topic, "k", f"k:{i}") for i in range(5)])
    elector = ManualElector(leader=False)
    h = make_harvester(elector=elector)
    time.sleep(1.0)
    with psycopg.connect(services.pg_dsn) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(outbox.ident)).fetchone()
    assert row == (5,) and h.metrics.published._value.get() == 0
    elector.acquire()
    assert wait_until(lambda: wait_drained(services.pg_dsn, outbox, timeout=0) == 0)

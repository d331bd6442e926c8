"""The de-duplicating reader against real Kafka and PostgreSQL.

The topics are written directly with a confluent-kafka producer, copy by copy, exactly as the
harvester would have written them in each fault pattern (identity headers included); the
end-to-end test in test_harvester.py has a real harvester produce the duplicates.
"""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Callable, Sequence
from typing import Any

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, Message, Producer, TopicPartition
from prometheus_client import CollectorRegistry
from psycopg import sql

from harvester.client.dedup import DedupReader
from tests.dedup.kafka import by_key, consumer, ends, expected, produce, read_to
from tests.dedup.model import Copy, first_copies, random_stream
from tests.support.kafka import text
from tests.support.services import Services

pytestmark = pytest.mark.integration

# One key per fault pattern of the engine; (key, outbox id, epoch) in partition order.
PATTERNS: list[Copy] = [
    # Out-of-id-order writers, no fault: 11 committed before 10. Nothing may be dropped.
    ("ooo", 11, 1),
    ("ooo", 10, 1),
    ("ooo", 12, 1),
    # Failed delivery that landed, reset and remarked: the same record again, same epoch.
    ("remark", 20, 1),
    ("remark", 20, 1),
    ("remark", 21, 1),
    # Crash after delivery, before purge: the new leader re-marks in id order, a late lower id first.
    ("failover", 31, 1),
    ("failover", 30, 2),
    ("failover", 31, 2),
    ("failover", 32, 2),
    # Fenced zombie: epoch 2 re-publishes 41 and moves on; the zombie's copy of 41 lands much later.
    *[("zombie", i, 2) for i in range(41, 50)],
    ("zombie", 41, 1),
    ("zombie", 50, 2),
]


def test_induced_duplicates_each_record_once_in_key_order(services: Services, topics: Callable[..., str]) -> None:
    topic = topics(partitions=2)
    bulk = [(f"m{k}", 1000 + rid, epoch) for k, rid, epoch in random_stream(seed=7, keys=6, steps=1500)]
    stream = PATTERNS + bulk
    produce(services.bootstrap, topic, stream)
    plain = Producer({"bootstrap.servers": services.bootstrap})
    for _ in range(2):  # no identity headers: never de-duplicated
        plain.produce(topic, key=b"plain", value=b"plain:0")
    assert plain.flush(30) == 0

    registry = CollectorRegistry()
    with consumer(services) as c:
        reader = DedupReader(c, registry=registry)
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(2)])
        kept = read_to(reader, ends(c, topic, 2))

    got = by_key(kept)
    assert got.pop("plain") == ["plain:0", "plain:0"]
    assert got == expected(stream)
    assert got["ooo"] == ["ooo:11", "ooo:10", "ooo:12"]
    dropped = len(stream) - len(first_copies(stream))
    assert dropped >= 20  # the bulk has every kind of duplicate
    assert reader.duplicates_dropped == dropped
    assert registry.get_sample_value("harvester_dedup_duplicates_dropped_total") == dropped


def test_poll_yields_each_record_once_and_none_when_only_copies_remain(
    services: Services, topics: Callable[..., str]
) -> None:
    """``poll``, record by record, on the fault patterns; the partition ends with copies only, which
    the polls after the last record drop, returning None at their timeout, up to the partition's end."""
    topic = topics()
    stream = [*PATTERNS, ("remark", 20, 1), ("zombie", 41, 1)]
    produce(services.bootstrap, topic, stream)
    with consumer(services) as c:
        reader = DedupReader(c)
        reader.assign([TopicPartition(topic, 0, OFFSET_BEGINNING)])
        end = ends(c, topic, 1)
        kept: list[Message] = []
        wanted = len(first_copies(stream))
        while len(kept) < wanted and (m := reader.poll(10.0)) is not None:
            assert m.error() is None, m.error()
            kept.append(m)
        deadline = time.monotonic() + 30
        while reader.positions() != end and time.monotonic() < deadline:
            assert reader.poll(0.5) is None
    assert by_key(kept) == expected(stream)
    assert reader.duplicates_dropped == len(stream) - len(first_copies(stream))
    assert reader.positions() == end


# The rebalance protocols a subscribed reader meets: eager, cooperative (KIP-429) and the
# broker-driven consumer protocol (KIP-848); the last two add partitions incrementally.
PROTOCOLS = {
    "eager": {},
    "cooperative-sticky": {"partition.assignment.strategy": "cooperative-sticky"},
    "consumer-protocol": {"group.protocol": "consumer"},
}


@pytest.mark.parametrize("protocol", list(PROTOCOLS))
def test_restart_from_checkpoint_still_exactly_once(
    services: Services, topics: Callable[..., str], pg: psycopg.Connection[Any], schema: str, protocol: str
) -> None:
    topic = topics(partitions=2)
    received = sql.Identifier(schema, "received")
    table = f"{schema}.dedup_checkpoint"
    pg.execute(sql.SQL("CREATE TABLE {} (seq bigserial PRIMARY KEY, key text, value text)").format(received))
    # Every second copy of a record lands after the restart point: the restored state must catch it.
    before: list[Copy] = [("a", 1, 1), ("a", 2, 1), ("b", 11, 1), ("b", 10, 2), ("c", 31, 2)]
    before += [("z", i, 2) for i in range(21, 27)]
    after: list[Copy] = [("a", 2, 2), ("a", 3, 2), ("b", 11, 2), ("b", 12, 2), ("c", 31, 2), ("c", 32, 2)]
    after += [("z", 21, 1), ("z", 27, 2)]

    def apply(conn: psycopg.Connection[Any], reader: DedupReader, messages: Sequence[Message]) -> None:
        """The consumer's work and its checkpoint, in one transaction."""
        with conn.cursor() as cur:
            cur.executemany(
                sql.SQL("INSERT INTO {} (key, value) VALUES (%s, %s)").format(received),
                [(text(m.key()), text(m.value())) for m in messages],
            )
        reader.checkpoint(conn, "orders", table=table)

    produce(services.bootstrap, topic, before)
    with consumer(services) as c, psycopg.connect(services.pg_dsn, autocommit=True) as conn:
        first = DedupReader.load(conn, "orders", c, table=table)  # no checkpoint yet: a fresh reader
        first.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(2)])
        with conn.transaction():
            apply(conn, first, read_to(first, ends(c, topic, 2)))
        produce(services.bootstrap, topic, after)
        # Crash mid-transaction: the second batch's effects and checkpoint never commit.
        with pytest.raises(RuntimeError), conn.transaction():
            apply(conn, first, read_to(first, ends(c, topic, 2)))
            raise RuntimeError("crash")
        assert first.duplicates_dropped == 4

    # A new process, a new consumer group starting at "latest": only the checkpoint says where to resume.
    with (
        consumer(services, **{"auto.offset.reset": "latest"}, **PROTOCOLS[protocol]) as c,
        psycopg.connect(services.pg_dsn, autocommit=True) as conn,
    ):
        second = DedupReader.load(conn, "orders", c, table=table, cooperative=protocol != "eager")
        c.subscribe([topic], on_assign=second.on_assign)
        with conn.transaction():
            apply(conn, second, read_to(second, ends(c, topic, 2)))
        assert second.duplicates_dropped == 4
        row = conn.execute(sql.SQL("SELECT offsets FROM {}").format(sql.Identifier(schema, "dedup_checkpoint")))
        saved = row.fetchone()
        assert saved is not None and saved[0] == second.offsets()

    rows = pg.execute(sql.SQL("SELECT key, value FROM {} ORDER BY seq").format(received)).fetchall()
    got: dict[str, list[str]] = defaultdict(list)
    for key, value in rows:
        got[str(key)].append(str(value))
    assert dict(got) == expected(before + after)


@pytest.mark.parametrize(("protocol", "cooperative"), [("eager", True), ("cooperative-sticky", False)])
def test_a_reader_that_mismatches_the_rebalance_protocol_says_how_to_fix_it(
    services: Services, topics: Callable[..., str], protocol: str, cooperative: bool
) -> None:
    topic = topics(partitions=1)
    with consumer(services, **PROTOCOLS[protocol]) as c:
        reader = DedupReader(c, cooperative=cooperative)
        c.subscribe([topic], on_assign=reader.on_assign)
        with pytest.raises(RuntimeError, match=f"create the reader with cooperative={not cooperative}"):
            deadline = time.monotonic() + 30
            while time.monotonic() < deadline:
                reader.poll(0.5)

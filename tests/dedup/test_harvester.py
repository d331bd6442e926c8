"""End to end: a real harvester re-publishes records after a failover; the reader drops the copies."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from psycopg import sql

from harvester.client.dedup import DedupReader
from harvester.core.identity import Identity
from harvester.postgres.schema.identifiers import TableName
from tests.dedup.kafka import consumer, ends, read_to
from tests.engine.workload import insert, wait_drained, wait_until
from tests.support.harvesters import HarvesterFactory, ManualElector
from tests.support.kafka import consumed_headers, text
from tests.support.services import Services

pytestmark = pytest.mark.integration

KEYS = [f"k{i}" for i in range(10)]


def test_copies_republished_by_a_new_term_are_dropped(
    services: Services,
    outbox: TableName,
    schema: str,
    pg: psycopg.Connection[Any],
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
) -> None:
    topic = topics(partitions=2)
    insert(services.pg_dsn, outbox, [(topic, k, f"{k}:{i}") for i in range(5) for k in KEYS])
    # The first term's purge of each key's last record is lost, as when a leader crashes between
    # the acknowledgement and the purge: the next term re-marks and re-publishes exactly those.
    unpurged = sql.Identifier(schema, "unpurged")
    pg.execute(sql.SQL("CREATE TABLE {} (id bigint PRIMARY KEY)").format(unpurged))
    pg.execute(sql.SQL("INSERT INTO {} SELECT max(id) FROM {} GROUP BY kafka_key").format(unpurged, outbox.ident))
    pg.execute(
        sql.SQL(
            "CREATE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF EXISTS (SELECT 1 FROM {u} WHERE id = OLD.id) THEN RETURN NULL; END IF; RETURN OLD; END $$"
        ).format(f=sql.Identifier(schema, "lose_purge"), u=unpurged)
    )
    pg.execute(
        sql.SQL("CREATE TRIGGER lose_purge BEFORE DELETE ON {} FOR EACH ROW EXECUTE FUNCTION {}()").format(
            outbox.ident, sql.Identifier(schema, "lose_purge")
        )
    )

    elector = ManualElector()
    harvester = make_harvester(elector=elector)
    assert wait_until(lambda: harvester.metrics.purged._value.get() >= 50)
    left = pg.execute(sql.SQL("SELECT count(*) FROM {}").format(outbox.ident)).fetchone()
    assert left is not None and left[0] == len(KEYS)
    pg.execute(sql.SQL("DELETE FROM {}").format(unpurged))
    elector.fence()
    elector.acquire()  # a new term, a new epoch: re-publishes the 10 unpurged records first
    insert(services.pg_dsn, outbox, [(topic, k, f"{k}:{i}") for i in range(5, 8) for k in KEYS])
    assert wait_drained(services.pg_dsn, outbox) == 0

    with consumer(services) as c:
        reader = DedupReader(c)
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(2)])
        end = ends(c, topic, 2)
        kept = read_to(reader, end)

    assert sum(end.values()) == 50 + len(KEYS) + 30  # the copies are really in the topic
    assert reader.duplicates_dropped == len(KEYS)
    got: dict[str, list[str]] = defaultdict(list)
    epochs: set[int] = set()
    for m in kept:
        identity = Identity.from_headers(consumed_headers(m))
        assert identity is not None
        epochs.add(identity.epoch)
        got[text(m.key())].append(text(m.value()))
    assert dict(got) == {k: [f"{k}:{i}" for i in range(8)] for k in KEYS}
    assert len(epochs) == 2

"""Induced duplicates with real processes: the leader is SIGKILLed after its batch was published
and before the purge committed; the standby publishes those records again, and the reader yields
each outbox record exactly once, in per-key order."""

from __future__ import annotations

import os
import signal
from collections import defaultdict
from collections.abc import Callable
from typing import Any

import psycopg
import pytest
from confluent_kafka import OFFSET_BEGINNING, TopicPartition
from psycopg import sql

from harvester.client.dedup import DedupReader
from harvester.postgres.schema.identifiers import TableName
from tests.dedup.kafka import consumer, ends, read_to
from tests.engine.workload import insert, wait_drained, wait_until
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.kafka import delete_topics, end_offsets
from tests.support.names import unique
from tests.support.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sigkill_before_purge_duplicates_are_dropped_by_the_reader(
    services: Services, outbox: TableName, schema: str, pg: psycopg.Connection[Any], topics: Callable[..., str]
) -> None:
    topic, group = topics(partitions=2), unique("dups")
    keys = [f"k{i}" for i in range(10)]
    insert(services.pg_dsn, outbox, [(topic, k, f"{k}:{i}") for i in range(3) for k in keys])
    # The first leader's purges hang, so it can be killed between acknowledgement and purge.
    stall = sql.Identifier(schema, "stall")
    pg.execute(
        sql.SQL(
            "CREATE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
            "IF current_setting('application_name') LIKE '%%doomed%%' THEN PERFORM pg_sleep(30); END IF; "
            "RETURN NULL; END $$"
        ).format(f=stall)
    )
    pg.execute(
        sql.SQL("CREATE TRIGGER stall BEFORE DELETE ON {} FOR EACH STATEMENT EXECUTE FUNCTION {}()").format(
            outbox.ident, stall
        )
    )

    def spec(name: str) -> dict[str, object]:
        return harvester_spec(services.pg_dsn, services.bootstrap, outbox, group, name)

    doomed = HarvesterProcess(spec("doomed"))
    standby: HarvesterProcess | None = None
    try:
        assert doomed.wait_for("LeaderAcquired"), doomed.log
        standby = HarvesterProcess(spec("standby"))
        # One record per key is in flight; wait until the first ten are in Kafka, then kill.
        assert wait_until(lambda: end_offsets(services.bootstrap, topic, 2) >= 10, timeout=30)
        os.kill(doomed.proc.pid, signal.SIGKILL)
        pg.execute("SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE application_name LIKE '%doomed%'")
        assert standby.wait_for("LeaderAcquired", timeout=30), standby.log
        assert wait_drained(services.pg_dsn, outbox, timeout=60) == 0
    finally:
        doomed.terminate()
        if standby is not None:
            standby.terminate()
        delete_topics(services.bootstrap, [f"{group}.neli"])

    with consumer(services) as c:
        reader = DedupReader(c)
        reader.assign([TopicPartition(topic, p, OFFSET_BEGINNING) for p in range(2)])
        end = ends(c, topic, 2)
        kept = read_to(reader, end)
    assert sum(end.values()) >= 40  # 30 records and at least 10 copies really are in the topic
    assert reader.duplicates_dropped == sum(end.values()) - 30
    got: dict[str, list[str]] = defaultdict(list)
    for m in kept:
        got[(m.key() or b"").decode()].append((m.value() or b"").decode())
    assert dict(got) == {k: [f"{k}:{i}" for i in range(3)] for k in keys}

"""A leader whose session broke lets its stream go (harvester/postgres/log/slot.py, ``let_go``).

A fast shutdown ends the sessions first, then waits until each walsender's client has answered its
last keepalive; a leader backing off from its failed statements does not read the stream, so the
shutdown waited for ``wal_sender_timeout`` (30 s): in 7 of 9 fast restarts of a private server
under an exactly-once or retention-window leader, against 1.3-2.4 s in 10 of 10 with the stream
let go (measured with a scratch script, at a load of ~30 on 2 cores). Here the sessions are ended
as a shutdown ends them, the server staying up: the leader's stream is started again (a new
walsender), nothing lost, every key in order, no copy past ``DedupReader``."""

from __future__ import annotations

from collections.abc import Callable

import psycopg
import pytest

from harvester import HarvesterConfig
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check, insert, wait_until
from tests.log.test_lost_slot import made, past_dedup
from tests.support.kafka import read_distinct
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration


def test_a_broken_session_lets_the_stream_go(
    services: Services, logical_dsn: str, log_outbox: TableName, topics: Callable[..., str]
) -> None:
    topic, name = topics(), unique("let-go")
    slot = HarvesterConfig(outbox_table=log_outbox.qualified).slot

    def walsender() -> int | None:
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            row = conn.execute("SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        return None if row is None or row[0] is None else int(row[0])

    with made(services, logical_dsn, log_outbox) as make:
        h = make(name=name)
        insert(logical_dsn, log_outbox, [(topic, "k", f"k:{i}") for i in range(10)])
        assert wait_until(lambda: h.metrics.purged._value.get() >= 10, timeout=60)
        first = walsender()
        assert first is not None
        written = 10
        # A new walsender seen once is the proof: a later failed statement (the purge's session was
        # ended too) may let that stream go again, its slot briefly unowned.
        others: set[int] = set()

        def restarted() -> bool:
            pid = walsender()
            if pid is not None and pid != first:
                others.add(pid)
            return bool(others)

        # Each round: the leader's sessions ended (not its walsender), then a record whose delete
        # runs on one. A round whose failure met a read under way lets nothing go (the read answers
        # the server): a few rounds at most.
        for _ in range(5):
            with psycopg.connect(logical_dsn, autocommit=True) as conn:
                conn.execute(
                    "SELECT pg_terminate_backend(pid) FROM pg_stat_activity"
                    " WHERE backend_type = 'client backend' AND application_name = %s",
                    (f"outbox-harvester {name}"[:63],),
                )
            insert(logical_dsn, log_outbox, [(topic, "k", f"k:{written}")])
            written += 1
            if wait_until(restarted, timeout=10):
                break
        assert others, "the leader's stream was never started again"
        messages = read_distinct(services.bootstrap, topic, written)
        verdict = check(messages, {"k": written})
        assert verdict.lost == [] and verdict.out_of_order == [] and past_dedup(messages) == 0, verdict

"""A paused leader (SIGSTOP past the session timeout) wakes up as a zombie: it changes no outbox row
after a standby took over (the chaos runs' audit, tests/chaos/audit.py), and per-key order of first
deliveries holds. And a leader whose purge a newer term overtook retries it against the fence and
changes nothing."""

from __future__ import annotations

import os
import signal
import time
import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from harvester import PostgresStore
from harvester.postgres.schema.identifiers import TableName
from tests.chaos import audit
from tests.engine.workload import check, insert, wait_drained, wait_until, writing
from tests.proc.processes import HarvesterProcess, blocked_statement, harvester_spec
from tests.support.kafka import read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def test_sigstopped_leader_changes_nothing_after_takeover(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    topic = topics(partitions=3)
    trail = audit.install(services.pg_dsn, outbox)
    group = unique("zombie")

    def spec(name: str) -> dict[str, object]:
        return harvester_spec(
            services.pg_dsn,
            services.bootstrap,
            outbox,
            group,
            name,
            limits={"mark_query_records": 10, "max_in_flight_records": 50},
        )

    a = HarvesterProcess(spec("zombie-a"))
    b: HarvesterProcess | None = None
    try:
        assert a.wait_for("LeaderAcquired"), a.log
        b = HarvesterProcess(spec("standby-b"))
        assert b.wait_for("started")
        writer = writing(services.pg_dsn, outbox, topic, keys=30, per_key=60, writers=3, per_txn=1)
        time.sleep(1.5)
        os.kill(a.proc.pid, signal.SIGSTOP)
        assert b.wait_for("LeaderAcquired", timeout=30), b.log
        time.sleep(2.0)  # the new leader publishes and purges meanwhile
        resumed = time.time()
        os.kill(a.proc.pid, signal.SIGCONT)
        writer.join()
        assert wait_drained(services.pg_dsn, outbox, timeout=90) == 0
        # The zombie reports that it no longer leads, whichever noticed first (elector or fence).
        assert a.wait_for("LeaderFenced", timeout=15, after=resumed) or a.seen("LeaderRevoked", after=resumed)
        history = audit.history(services.pg_dsn, trail)
        # The zombie did work before the pause, and changed nothing once the standby's term began.
        assert any(c.kind != audit.TERM and "zombie-a" in c.app for c in history)
        assert audit.past_fence(history) == []
    finally:
        a.terminate()
        if b is not None:
            b.terminate()
    verdict = check(read_messages(services.bootstrap, [topic], 1800), {f"k{i}": 60 for i in range(30)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0


def test_a_purge_retried_after_a_newer_term_changes_nothing(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    """The interleaving forced: the leader's purge of a delivered batch waits on a row the test
    locked; the leader is stopped, the statement cancelled and a newer term taken at the fence
    before it resumes. Its elector never noticed, so it retries the purge (ids close together:
    ``purge_range``) on rows that are all still there: the fence, not the elector, must refuse it."""
    topic = topics(partitions=2)
    insert(services.pg_dsn, outbox, [(topic, f"k{i % 6}", f"k{i % 6}:{i // 6}") for i in range(60)])
    with psycopg.connect(services.pg_dsn) as conn:
        ids = [int(r[0]) for r in conn.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(outbox.ident))]
    trail = audit.install(services.pg_dsn, outbox)
    spec = harvester_spec(
        services.pg_dsn, services.bootstrap, outbox, unique("zombie"), "purging-a",
        limits={"mark_query_records": 10, "max_in_flight_records": 30},
    )  # fmt: skip
    held = psycopg.connect(services.pg_dsn)
    heir = PostgresStore.open(services.pg_dsn, outbox, application_name="heir")
    a = None
    try:
        held.execute(sql.SQL("SELECT 1 FROM {} WHERE id = %s FOR UPDATE").format(outbox.ident), (ids[25],))
        a = HarvesterProcess(spec)
        assert wait_until(lambda: blocked_statement(services.pg_dsn, "purging-a") is not None), a.log
        os.kill(a.proc.pid, signal.SIGSTOP)
        blocked = blocked_statement(services.pg_dsn, "purging-a")
        assert blocked is not None and "DELETE" in blocked[1] and "BETWEEN" in blocked[1], blocked  # purge_range
        with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
            assert conn.execute("SELECT pg_cancel_backend(%s)", (blocked[0],)).fetchone() == (True,)
        held.rollback()
        heir.acquire(uuid.uuid4())  # a newer term, while the stopped leader's batch is unpurged
        os.kill(a.proc.pid, signal.SIGCONT)
        # It learns of the fence from its retried purge and takes the outbox back (its elector still
        # says it leads), then drains it.
        assert wait_drained(services.pg_dsn, outbox, timeout=60) == 0
        history = audit.history(services.pg_dsn, trail)
    finally:
        held.close()
        heir.close()
        if a is not None:
            a.terminate()
    terms = [c.app for c in history if c.kind == audit.TERM]
    assert terms == ["outbox-harvester purging-a", "heir", "outbox-harvester purging-a"], terms
    assert audit.past_fence(history) == []
    verdict = check(read_messages(services.bootstrap, [topic], 60), {f"k{i}": 10 for i in range(6)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0

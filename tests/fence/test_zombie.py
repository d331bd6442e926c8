"""A paused leader (SIGSTOP past the session timeout) wakes up as a zombie: it changes no outbox row
after a standby took over (the chaos runs' audit, tests/chaos/audit.py), and per-key order of first
deliveries holds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import pytest

from harvester.postgres.schema.identifiers import TableName
from tests.chaos import audit
from tests.engine.workload import check, wait_drained, writing
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support import Services, read_messages, unique

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

"""docs/architecture.md's threads table names every thread a running harvester starts, by its real
name (issue 43): the table is compared with ``threading.enumerate()``."""

from __future__ import annotations

import re
import threading
from collections.abc import Callable
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest

from harvester import Harvester, HarvesterConfig, Limits, OutboxRecord, Stasher
from harvester.core.events import Event, LeaderAcquired
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import wait_drained
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

DOC = Path(__file__).resolve().parents[2] / "docs" / "architecture.md"


def documented() -> list[re.Pattern[str]]:
    """The thread names in the first column of the Threads table, ``<name>`` standing for any text
    and every name also matching with a shard's suffix (``harvester-mark-2``)."""
    section = DOC.read_text("utf-8").split("\n## Threads\n", 1)[1].split("\n## ", 1)[0]
    cells = [row.split("|")[1] for row in section.splitlines() if row.startswith("| `")]
    names = [name for cell in cells for name in re.findall(r"`([^`]+)`", cell)]
    return [re.compile(".+".join(map(re.escape, re.split(r"<[^>]+>", n))) + r"(-\d+)?") for n in names]


def test_the_threads_table_names_every_thread_of_a_running_harvester(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    topic = topics()
    before = set(threading.enumerate())
    acquired = threading.Event()

    def on_event(event: Event) -> None:
        if isinstance(event, LeaderAcquired):
            acquired.set()

    config = HarvesterConfig(
        data_source=services.pg_dsn,
        outbox_table=outbox.qualified,
        base_kafka_config={"bootstrap.servers": services.bootstrap},
        leader_group_id=unique("group"),
        limits=Limits(
            heartbeat_timeout=timedelta(seconds=3),
            statement_timeout=timedelta(seconds=30),  # the deadline's watchdog runs too
            vacuum_every_records=1,  # and the vacuum thread
        ),
    )
    harvester = Harvester(config, on_event=on_event)
    harvester.start()
    try:
        assert acquired.wait(30)
        with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
            Stasher(outbox.qualified).stash(conn, [OutboxRecord.of(topic, "k", b"v")] * 2)
        assert wait_drained(services.pg_dsn, outbox) == 0
        running = sorted(t.name for t in set(threading.enumerate()) - before)
    finally:
        harvester.stop(timeout=10)
    patterns = documented()
    assert "harvester-mark" in running and "harvester-complete" in running
    assert [n for n in running if not any(p.fullmatch(n) for p in patterns)] == []

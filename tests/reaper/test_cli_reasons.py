"""What the reaper says when something is wrong or missing (issue 23), through the console script on
the real services: ``run`` gives libpq's reason for a refused connection (and never the password),
``check`` agrees with ``run`` about the leader topic, ``migrate`` says when it created a schema, and
an unreachable or refusing Kafka is named by its cause and the setting to look at."""

from __future__ import annotations

import json
import signal
import subprocess
import time
import urllib.error
import urllib.request
from pathlib import Path

import psycopg
import pytest
from confluent_kafka.admin import AdminClient
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harvester import migrate
from harvester.daemon.outboxes import start_error
from harvester.kafka.topics import KafkaUnreachableError, ensure_checkpoints
from harvester.postgres.schema.identifiers import TableName
from tests.support.kafka import delete_topics
from tests.support.names import unique
from tests.support.paths import ROOT
from tests.support.ports import free_ports
from tests.support.private_services import PrivatePostgres
from tests.support.reaper import REAPER, reaper_environment, run_reaper
from tests.support.services import Services

pytestmark = pytest.mark.integration

SECRET = "Wr0ng-Issue23-S3cret"


def write_config(tmp_path: Path, dsn: str, table: str, bootstrap: str, topic: str = "") -> str:
    path = tmp_path / "reaper.yaml"
    lines = [
        "harvest:",
        f"  dataSource: {json.dumps(dsn)}",
        f"  outboxTable: {table}",
        "  baseKafkaConfig:",
        f"    bootstrap.servers: '{bootstrap}'",
    ]
    if topic:
        lines += [f"  leaderTopic: {topic}", f"  leaderGroupID: {topic}"]
    path.write_text("\n".join([*lines, "http:", "  port: 0", ""]))
    return str(path)


def error_lines(stderr: str) -> list[str]:
    """stderr without the JSON log records (the reaper's logs go to stderr too)."""
    return [line for line in stderr.splitlines() if not line.startswith("{")]


# ------------------------------------------------------------------ 1. run: libpq's reason, no password


def test_run_with_a_wrong_password_says_why_and_not_the_password(
    private_pg: PrivatePostgres, services: Services, tmp_path: Path
) -> None:
    dsn = make_conninfo(private_pg.dsn, password=SECRET)  # private_pg checks passwords
    done = run_reaper("run", "-f", write_config(tmp_path, dsn, "outbox", services.bootstrap, unique("lead")))
    assert done.returncode == 2, done.stderr
    errors = error_lines(done.stderr)
    assert len(errors) == 1, done.stderr
    line = errors[0]
    assert line.startswith("reaper: error: PostgreSQL (harvest.dataSource, harvest.outboxTable): ")
    assert 'password authentication failed for user "harvester"' in line
    assert "OperationalError" not in line and "Traceback" not in done.stderr
    assert SECRET not in done.stdout + done.stderr
    # What else reaches stderr is log records, redacted as well.
    for record in done.stderr.splitlines():
        if record.startswith("{"):
            json.loads(record)


def test_run_redacts_the_password_from_libpq_s_reason(services: Services, tmp_path: Path) -> None:
    # libpq quotes the database name; when it is also the password, the reason must not show it.
    dsn = make_conninfo(services.pg_dsn, dbname=SECRET, password=SECRET)
    done = run_reaper("run", "-f", write_config(tmp_path, dsn, "outbox", services.bootstrap, unique("lead")))
    assert done.returncode == 2, done.stderr
    (line,) = error_lines(done.stderr)
    assert 'database "***" does not exist' in line, line
    assert SECRET not in done.stdout + done.stderr


def test_run_with_a_wrong_port_says_why(services: Services, tmp_path: Path) -> None:
    dsn = make_conninfo(services.pg_dsn, host="127.0.0.1", port=str(free_ports(1)), password=SECRET)
    done = run_reaper("run", "-f", write_config(tmp_path, dsn, "outbox", services.bootstrap, unique("lead")))
    assert done.returncode == 2, done.stderr
    (line,) = error_lines(done.stderr)
    assert "Connection refused" in line and "Is the server running" not in line  # libpq's first line only
    assert SECRET not in done.stdout + done.stderr


# ------------------------------------------------------------------ 2. check and run agree on the leader topic


def _topic_exists(bootstrap: str, topic: str) -> bool:
    found = AdminClient({"bootstrap.servers": bootstrap}).list_topics(timeout=10).topics.get(topic)
    return found is not None and found.error is None


def test_check_on_a_fresh_group_says_run_creates_the_leader_topic(
    services: Services, outbox: TableName, tmp_path: Path
) -> None:
    topic = unique("fresh-lead")
    path = write_config(tmp_path, services.pg_dsn, outbox.qualified, services.bootstrap, topic)
    try:
        fresh = run_reaper("check", "-f", path)
        assert fresh.returncode == 0, fresh.stdout + fresh.stderr
        assert f"leader topic {topic}: absent; reaper run creates it (1 partition)" in fresh.stdout
        assert "problem" not in fresh.stdout
        assert fresh.stdout.rstrip().endswith("configuration ok")
        assert not _topic_exists(services.bootstrap, topic)  # check itself creates nothing

        # ... and run does create it.
        daemon = subprocess.Popen(
            [*REAPER, "run", "-f", path],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
            env=reaper_environment(),
        )
        try:
            deadline = time.monotonic() + 60
            while not _topic_exists(services.bootstrap, topic):
                assert daemon.poll() is None, daemon.stderr.read() if daemon.stderr else ""
                assert time.monotonic() < deadline, "reaper run did not create the leader topic"
                time.sleep(0.5)
        finally:
            daemon.send_signal(signal.SIGTERM)
            _, err = daemon.communicate(timeout=60)
        assert daemon.returncode == 0, err

        again = run_reaper("check", "-f", path)
        assert again.returncode == 0, again.stdout + again.stderr
        assert f"leader topic {topic}: present, 1 partition(s)" in again.stdout
    finally:
        delete_topics(services.bootstrap, [topic])


# ------------------------------------------------------------------ 4. migrate says when it created a schema


def test_migrate_says_it_created_the_schema(
    services: Services, pg: psycopg.Connection[tuple[object, ...]], schema: str, tmp_path: Path
) -> None:
    new = unique("s")
    try:
        path = write_config(tmp_path, services.pg_dsn, f"{new}.outbox", services.bootstrap)
        first = run_reaper("migrate", "-f", path)
        assert first.returncode == 0, first.stderr
        lines = first.stdout.splitlines()
        assert lines[0] == f"schema {new}: created"
        assert lines[1].startswith(f"outbox table {new}.outbox: applied 0001_outbox")
        again = run_reaper("migrate", "-f", path)
        assert (again.returncode, again.stdout) == (0, f"outbox table {new}.outbox: up to date\n")

        # A schema that existed already (the fixture's) is not reported.
        old = write_config(tmp_path, services.pg_dsn, f"{schema}.outbox", services.bootstrap)
        existing = run_reaper("migrate", "-f", old)
        assert existing.returncode == 0, existing.stderr
        assert "schema" not in existing.stdout and existing.stdout.startswith(f"outbox table {schema}.outbox: applied")
    finally:
        pg.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(new)))


# ------------------------------------------------------------------ 5. Kafka: the cause, the setting, one line


def test_run_with_kafka_unreachable_names_the_cause_and_bootstrap_servers(services: Services, tmp_path: Path) -> None:
    """One section: run waits startup.kafkaTimeout for Kafka, then exits 2 in one line naming the cause
    and the setting. Two (a list), the second's Kafka unreachable: the same wait and warning, but then
    the first runs and leads while the second is retried in the background, named with its cause on
    /healthz, /readyz and in the log; SIGTERM stops both with exit 0. Both run at once, with the wait
    set by REAPER_STARTUP__KAFKA_TIMEOUT to 8 s (the default 30 s cost the test 39 s on CI)."""
    port = free_ports(1)
    one = write_config(tmp_path, services.pg_dsn, "outbox", f"127.0.0.1:{port}", unique("lead"))
    schema, group = unique("kafka_down"), unique("lead")
    with psycopg.connect(services.pg_dsn, autocommit=True) as pg:
        migrate(pg, TableName(schema, "outbox"))
    two = tmp_path / "two.yaml"
    sections = [
        f"  - dataSource: {json.dumps(services.pg_dsn)}\n    outboxTable: {table}\n    leaderGroupID: {lead}\n"
        f"    baseKafkaConfig: {{bootstrap.servers: '{servers}'}}\n"
        for table, lead, servers in (
            (f"{schema}.outbox", group, services.bootstrap),
            ("b_outbox", unique("lead"), f"127.0.0.1:{port}"),
        )
    ]
    two.write_text("harvest:\n" + "".join(sections) + "http:\n  port: 0\nlogging: {format: json}\n")
    two_log = tmp_path / "two.log"
    with two_log.open("w") as sink:
        several = subprocess.Popen(
            [*REAPER, "run", "-f", str(two)],
            stdout=subprocess.DEVNULL,
            stderr=sink,
            stdin=subprocess.DEVNULL,
            env=reaper_environment(REAPER_STARTUP__KAFKA_TIMEOUT="8s"),
            cwd=ROOT,
        )
    alone = subprocess.Popen(
        [*REAPER, "run", "-f", one],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        stdin=subprocess.DEVNULL,
        text=True,
        env=reaper_environment(REAPER_STARTUP__KAFKA_TIMEOUT="8s"),
        cwd=ROOT,
    )
    reason = f"Kafka unreachable at 127.0.0.1:{port} (harvest.baseKafkaConfig: bootstrap.servers): "
    cause = f"Connect to ipv4#127.0.0.1:{port} failed: Connection refused"
    try:
        _, stderr = alone.communicate(timeout=90)
        assert alone.returncode == 2, stderr
        (line,) = error_lines(stderr)
        assert line == f"reaper: error: {reason}{cause}"
        records = [json.loads(r) for r in stderr.splitlines() if r.startswith("{")]
        # One warning while it retries (bounded: startup.kafkaTimeout), no librdkafka line repeated.
        assert [r["event"] for r in records if r["level"] != "info"] == ["kafka_unreachable"]
        assert not [r for r in records if r.get("logger") == "rdkafka"]
        assert "KafkaError{" not in stderr and "leaderTopic" not in stderr

        def logged() -> list[dict[str, object]]:
            return [json.loads(r) for r in two_log.read_text().splitlines() if r.startswith("{")]

        def probe(path: str) -> tuple[int, dict[str, object]]:
            started = next(r for r in logged() if r["event"] == "reaper_started")
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{started['http_port']}{path}", timeout=5) as resp:
                    return int(resp.status), json.loads(resp.read())
            except urllib.error.HTTPError as err:
                return int(err.code), json.loads(err.read())

        def outboxes() -> dict[str, dict[str, object]]:
            return probe("/readyz")[1]["outboxes"]  # type: ignore[return-value]

        def first_leads() -> bool:
            if not any(r["event"] == "reaper_started" for r in logged()):
                return False
            return bool(outboxes().get(first, {}).get("is_leader"))

        first, second = f"{schema}.outbox", "b_outbox"
        deadline = time.monotonic() + 60
        while not first_leads():
            assert several.poll() is None and time.monotonic() < deadline, two_log.read_text()
            time.sleep(0.5)
        status, health = probe("/healthz")
        assert status == 200, health  # an outbox retried is no reason to restart the process
        retrying = health["retrying"]
        assert isinstance(retrying, dict) and list(retrying) == [second] and retrying[second].endswith(cause)
        ready = outboxes()
        assert ready[second]["state"] == "retrying" and str(ready[second]["error"]).endswith(cause)
        assert ready[first]["state"] == "running"
        failed = [r for r in logged() if r["event"] == "outbox_start_failed"]
        assert failed and {r["outbox"] for r in failed} == {second} and str(failed[0]["error"]).endswith(cause)
        several.send_signal(signal.SIGTERM)
        assert several.wait(60) == 0, two_log.read_text()
        assert error_lines(two_log.read_text()) == []
        assert [r["event"] for r in logged() if r["level"] == "warning"] == ["kafka_unreachable"]
    finally:
        for proc in (alone, several):
            if proc.poll() is None:
                proc.kill()
                proc.wait()
        delete_topics(services.bootstrap, [f"{group}.neli"])
        with psycopg.connect(services.pg_dsn, autocommit=True) as pg:
            pg.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def test_a_checkpoint_topic_lookup_with_kafka_unreachable_is_kafka_unreachable() -> None:
    """Exactly once, the start looks up the checkpoint topic before the leader topic: no broker
    answering it is "Kafka unreachable" (one line, exit 2, retried in the background among several
    sections), not a crash (it was "cannot start: KafkaException", exit 1)."""
    servers = f"127.0.0.1:{free_ports(1)}"
    with pytest.raises(KafkaUnreachableError) as raised:
        ensure_checkpoints({"bootstrap.servers": servers, "log_level": 0}, "c.checkpoints", 1, timeout=1.0)
    failed = start_error(raised.value)
    assert failed.code == 2
    assert str(failed).startswith(f"Kafka unreachable at {servers} (harvest.baseKafkaConfig: bootstrap.servers): ")
    assert "\n" not in str(failed)


def test_check_names_a_sasl_handshake_failure(services: Services, tmp_path: Path) -> None:
    path = tmp_path / "reaper.yaml"
    path.write_text(
        "harvest:\n"
        f"  dataSource: {json.dumps(services.pg_dsn)}\n"
        "  baseKafkaConfig:\n"
        f"    bootstrap.servers: {services.bootstrap}\n"
        "    security.protocol: SASL_PLAINTEXT\n"
        "    sasl.mechanism: SCRAM-SHA-512\n"
        "    sasl.username: reaper\n"
        f"    sasl.password: {SECRET}\n"
    )
    done = run_reaper("check", "-f", str(path))
    assert done.returncode == 2, done.stdout + done.stderr
    (line,) = error_lines(done.stderr)
    assert line.startswith(
        f"reaper: error: Kafka unreachable at {services.bootstrap} (harvest.baseKafkaConfig: security.protocol, "
        "sasl.mechanism, sasl.username, sasl.password): SASL SCRAM-SHA-512 mechanism handshake failed"
    ), line
    assert "Broker transport failure" not in line
    assert SECRET not in done.stdout + done.stderr


# ------------------------------------------------------------------ 3. defaults: said before anything can fail


def test_run_on_an_empty_file_names_the_defaulted_connections_before_failing(tmp_path: Path) -> None:
    """A broken ConfigMap (an empty file): the connection settings left to their defaults are logged
    first, so the one-line failure that follows is read knowing where the reaper connected."""
    empty = tmp_path / "reaper.yaml"
    empty.write_text("")
    env = reaper_environment(REAPER_HARVEST__OUTBOX_TABLE=f"{unique('absent')}.outbox", REAPER_HTTP__PORT="0")
    done = run_reaper("run", "-f", str(empty), env=env)
    assert done.returncode == 2, done.stderr
    lines = done.stderr.splitlines()
    first = json.loads(lines[0])
    assert (first["event"], [s.split(" ")[0] for s in first["settings"]]) == (
        "connection_defaults",
        ["harvest.dataSource", "harvest.baseKafkaConfig"],
    )
    assert lines[-1].startswith("reaper: error: ") and "password" not in done.stderr

"""Each security mistake is one line from ``reaper check`` and from ``reaper run`` (which exits at once,
without waiting out Kafka's start bound) naming what is missing and the setting or grant that fixes it;
no password in any output."""

from __future__ import annotations

import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from tests.secure import services as s
from tests.secure.test_drain import acls
from tests.support.names import unique
from tests.support.reaper import run_reaper


@pytest.fixture(scope="module")
def other_ca(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """A CA that did not sign the services' certificates."""
    where = tmp_path_factory.mktemp("other-ca")
    subprocess.run(
        [
            "openssl",
            "req",
            "-x509",
            "-newkey",
            "rsa:2048",
            "-nodes",
            "-days",
            "2",
            "-subj",
            "/CN=other CA",
            "-keyout",
            str(where / "ca.key"),
            "-out",
            str(where / "ca.crt"),
        ],
        check=True,
        capture_output=True,
    )
    return where / "ca.crt"


@pytest.fixture(scope="module")
def box(secure: None, tmp_path_factory: pytest.TempPathFactory) -> s.Outbox:
    """One polling outbox for every case: each case breaks only its own reaper file or principal."""
    made = s.outbox(tmp_path_factory.mktemp("errors"), {})
    group = f"outbox-harvester.{made.table}"
    s.create_topics([f"{group}.neli", f"out_{made.schema}"])
    return made


CASES: dict[str, tuple[str, str]] = {  # case -> (what check's line says, what run's says)
    "pg_wrong_ca": ("certificate verify failed (sslrootcert:", "certificate verify failed (sslrootcert:"),
    "pg_host_mismatch": ('does not match host name "127.0.0.1" (host:', "does not match host name"),
    "pg_wrong_password": ("password authentication failed", "password authentication failed"),
    "kafka_wrong_ca": ("not signed by a CA in ssl.ca.location", "(harvest.baseKafkaConfig: ssl.ca.location"),
    "kafka_host_mismatch": ("does not name '127.0.0.1'", "(harvest.baseKafkaConfig: bootstrap.servers"),
    "kafka_wrong_password": ("sasl.password): SASL authentication error", "SASL authentication error"),
    "no_leader_topic_acl": ("may not READ and WRITE topic outbox-harvester.", "allow READ and WRITE on topic"),
    "no_group_acl": ("may not READ group outbox-harvester.", "allow READ on group"),
    "no_grant": ("lacks DELETE on s_", "GRANT DELETE ON s_"),
}


@pytest.mark.parametrize("case", list(CASES))
def test_one_line_naming_the_fix(box: s.Outbox, other_ca: Path, tmp_path: Path, case: str) -> None:
    group = f"outbox-harvester.{box.table}"
    rules = acls(group, f"out_{box.schema}", exactly_once=False)
    dropped = {"no_leader_topic_acl": f"{group}.neli", "no_group_acl": group}.get(case)
    user = s.principal([a for a in rules if a.name != dropped])
    dsn: dict[str, Any] = {}
    kafka = s.kafka_config(user, s.PASSWORD)
    password = s.PASSWORD
    role = box.runtime
    if case == "pg_wrong_ca":
        dsn["sslrootcert"] = str(other_ca)
    elif case == "pg_host_mismatch":
        dsn["host"] = "127.0.0.1"
    elif case == "pg_wrong_password":
        password = "wrong-pw-secret"
    elif case == "kafka_wrong_ca":
        kafka["ssl.ca.location"] = str(other_ca)
    elif case == "kafka_host_mismatch":
        kafka["bootstrap.servers"] = f"127.0.0.1:{s.KAFKA_PORT}"
    elif case == "kafka_wrong_password":
        kafka["sasl.password"] = "wrong-pw-secret"
    elif case == "no_grant":  # a role of its own, given the grants less DELETE on the outbox
        role = restricted_role(box, tmp_path)
    config = s.write(tmp_path / "reaper.yaml", box.table, s.pg_dsn(role, password, **dsn), kafka, {})
    checked, ran = s.reapers(["check", "-f", str(config)], ["run", "-f", str(config)])
    expected_check, expected_run = CASES[case]
    problems = [line for line in checked.stdout.splitlines() if line.startswith("problem: ")]
    check_says = problems or checked.stderr.splitlines()
    assert checked.returncode in (1, 2) and len(check_says) == 1, checked.stdout + checked.stderr
    assert expected_check in check_says[0], check_says[0]
    assert ran.returncode == 2, ran.stderr[-2000:]
    run_says = ran.stderr.splitlines()[-1]
    assert run_says.startswith("reaper: error: ") and expected_run in run_says, run_says
    for output in (checked.stdout, checked.stderr, ran.stdout, ran.stderr):
        assert s.PASSWORD not in output and "wrong-pw-secret" not in output


def restricted_role(box: s.Outbox, tmp: Path) -> str:
    role = unique("rt")
    grants = run_reaper("grants", "-f", str(s.write(tmp / "grants.yaml", box.table, s.pg_dsn(role), {}, {})))
    with psycopg.connect(s.pg_dsn(), autocommit=True) as conn:
        conn.execute(grants.stdout.encode())
        conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(role), s.PASSWORD))
        outbox = sql.Identifier(box.schema, "outbox")
        conn.execute(sql.SQL("REVOKE DELETE ON {} FROM {}").format(outbox, sql.Identifier(role)))
    return role


def test_a_refused_transactional_id_ends_run_with_one_line(secure: None, tmp_path: Path) -> None:
    """Asking whether the principal may use the transactional id would fence the leader, so check
    cannot; run stops when its term starts (exit 1) with one line naming the ACL, and keeps the records."""
    harvest = {"delivery": "exactly_once"}
    made = s.outbox(tmp_path, harvest)
    group = f"outbox-harvester.{made.table}"
    topic = f"out_{made.schema}"
    s.create_topics([topic, f"{group}.neli", f"{group}.checkpoints"])
    user = s.principal([a for a in acls(group, topic, exactly_once=True) if a.name != f"{group}.harvester"])
    kafka = s.kafka_config(user, s.PASSWORD)
    config = s.write(tmp_path / "reaper.yaml", made.table, s.pg_dsn(made.runtime, s.PASSWORD), kafka, harvest)
    s.stash(made.table, 3, topic)
    (ran,) = s.reapers(["run", "-f", str(config)])
    wanted = f"reaper: error: Kafka ACL missing: may not WRITE transactional id {group}.harvester: allow WRITE"
    assert ran.returncode == 1 and ran.stderr.splitlines()[-1].startswith(wanted), ran.stderr[-3000:]
    assert s.backlog(made.table) == 3
    assert s.PASSWORD not in ran.stdout + ran.stderr


def test_a_refused_output_topic_is_named_in_the_dead_letters(box: s.Outbox, tmp_path: Path) -> None:
    """The output topics are named by the rows, so check cannot look them up beforehand: a record
    refused for its topic is a dead letter (nothing lost: 'reaper dlq replay' sends it once the ACL is
    there) whose error names the ACL."""
    group = f"outbox-harvester.{box.table}"
    topic = f"out_{box.schema}"
    user = s.principal([a for a in acls(group, topic, exactly_once=False) if a.name != topic])
    kafka = s.kafka_config(user, s.PASSWORD)
    config = s.write(tmp_path / "reaper.yaml", box.table, s.pg_dsn(box.runtime, s.PASSWORD), kafka, {})
    s.stash(box.table, 2, topic)
    proc = s.reaper_process(config, tmp_path / "run.log")
    query = sql.SQL("SELECT error FROM {}").format(sql.Identifier(box.schema, "outbox_dead_letter"))
    try:
        deadline = time.monotonic() + 60
        with psycopg.connect(s.pg_dsn(), autocommit=True) as conn:
            while len(errors := [str(r[0]) for r in conn.execute(query)]) < 2:
                assert proc.poll() is None and time.monotonic() < deadline
                time.sleep(0.3)
    finally:
        proc.terminate()
        proc.wait(60)
    assert all(f"Kafka ACL missing: allow WRITE on topic {topic}" in e for e in errors), errors


@pytest.mark.parametrize("source", ["polling", "log"])
def test_a_producer_refused_a_producer_id_ends_run_with_one_line(box: s.Outbox, tmp_path: Path, source: str) -> None:
    """A producer principal (``producerKafkaConfig``) that may WRITE no topic is refused a producer id
    (Kafka's fatal ``Cluster authorization failed``): run stops with one line naming the ACL (exit 1)
    instead of a dead delivery thread or a child that dies and is started again batch after batch,
    with the records in the outbox: the producer in the reaper's process (the polling source here,
    the default native loop) or in a child (``producerProcess: true``, the log source here)."""
    harvest: dict[str, Any] = {"source": "log", "producerProcess": True} if source == "log" else {}
    if source == "log":
        box = s.outbox(tmp_path, harvest)
        s.create_topics([f"outbox-harvester.{box.table}.neli", f"out_{box.schema}"])
    group = f"outbox-harvester.{box.table}"
    topic = f"out_{box.schema}"
    user = s.principal(acls(group, topic, exactly_once=False))
    writer = s.principal([])  # nothing at all
    kafka = s.kafka_config(user, s.PASSWORD)
    harvest["producerKafkaConfig"] = {"sasl.username": writer, "sasl.password": s.PASSWORD}
    config = s.write(tmp_path / "reaper.yaml", box.table, s.pg_dsn(box.runtime, s.PASSWORD), kafka, harvest)
    before = s.backlog(box.table)
    s.stash(box.table, 3, topic)
    (ran,) = s.reapers(["run", "-f", str(config)])
    wanted = "reaper: error: Kafka refused the producer: "
    last = ran.stderr.splitlines()[-1] if ran.stderr else ""
    assert ran.returncode == 1 and last.startswith(wanted), ran.stderr[-3000:]
    assert "allow WRITE on the output topics" in last and "Traceback" not in ran.stderr
    assert "producer_process_exited" not in ran.stderr  # the child lived to report it
    assert s.backlog(box.table) == before + 3
    assert s.PASSWORD not in ran.stdout + ran.stderr

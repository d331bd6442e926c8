"""``reaper status`` through the real CLI, on the real services: with nobody leading (exit 1), with a
leading reaper and a standby, after a handover, its one-line mistakes (exit 2), and a group lookup
that a broker answering nothing (as a paused one) lets time out (one line, exit 1)."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from types import SimpleNamespace
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harvester.daemon.status_report import Heartbeat, Member, Status, Term
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table
from tests.reaper.test_e2e import insert, wait_for
from tests.reaper.test_http_port import Process, goharvest_yaml
from tests.support.kafka import delete_topics
from tests.support.names import unique
from tests.support.postgres import create_goharvest_outbox
from tests.support.reaper import run_reaper
from tests.support.services import Services


def status(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_reaper("status", "-f", str(config), *args)


def status_json(config: Path) -> tuple[int, dict[str, Any]]:
    done = status(config, "--json")
    assert done.stderr == "", done.stderr
    doc = json.loads(done.stdout)
    assert isinstance(doc, dict)
    return done.returncode, doc


def fence_acquired(reaper: Process) -> dict[str, Any]:
    """The reaper's last ``fence_acquired`` log line: the epoch and leader id its term began with."""
    return reaper.events("fence_acquired")[-1]


@pytest.mark.integration
def test_status_with_nobody_then_a_leader_then_after_a_handover(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    topics: Callable[..., str],
    tmp_path: Path,
) -> None:
    table = TableName(schema, "outbox")
    topic = topics()
    group = unique("reaper-status")
    config = tmp_path / "reaper.yaml"
    config.write_text(goharvest_yaml(services, table, group))
    assert run_reaper("migrate", "-f", str(config)).returncode == 0

    # Before any reaper ran: three records an hour old and one dead letter waiting.
    insert(pg, table, topic, 0, 3)
    pg.execute(sql.SQL("UPDATE {} SET create_time = now() - interval '1 hour'").format(table.ident))
    pg.execute(
        sql.SQL(
            "INSERT INTO {} (id, create_time, kafka_topic, kafka_key, reason, error, attempts, first_failure,"
            " last_failure, epoch) VALUES (1000, now(), %s, 'k', 'permanent', 'too large', 3, now(), now(), 1)"
        ).format(dead_letter_table(table).ident),
        (topic,),
    )

    code, doc = status_json(config)
    assert code == 1
    assert doc["leader"] is None and doc["members"] == [] and doc["term"] is None and doc["heartbeat"] is None
    assert (doc["outbox_table"], doc["group"], doc["leader_topic"]) == (table.qualified, group, f"{group}.neli")
    assert doc["delivery"] == "at_least_once"
    assert (doc["backlog_records"], doc["in_flight_records"], doc["dead_letters"]) == (3, None, 1)
    assert doc["oldest_record_age_seconds"] >= 3600
    assert doc["lag_seconds"] == doc["oldest_record_age_seconds"]  # a row leaves only once acknowledged
    text = status(config)
    assert text.returncode == 1 and text.stderr == ""
    assert f"leader: none (no member holds partition 0 of {group}.neli)" in text.stdout
    assert "backlog: 3 record(s), oldest 36" in text.stdout  # 3600-3699 s
    assert "lag: 36" in text.stdout and "in flight: not reported (no leader's heartbeat carries it)" in text.stdout
    assert "dead letters: 1 waiting" in text.stdout

    reapers: list[Process] = []
    try:
        reapers = [Process(config, f"status-{i}", tmp_path) for i in range(2)]
        wait_for("one leader", lambda: sum(r.leads() for r in reapers if r.events("reaper_started")) == 1, 90)
        wait_for("the backlog to drain", lambda: status_json(config)[1]["backlog_records"] == 0, 60)
        wait_for("both reapers in the group", lambda: len(status_json(config)[1]["members"]) == 2, 60)

        (leader,) = [r for r in reapers if r.leads()]
        (standby,) = [r for r in reapers if r is not leader]
        code, doc = status_json(config)
        assert code == 0
        term = fence_acquired(leader)
        assert doc["leader"] == leader.name
        assert doc["term"]["leader_id"] == term["leader_id"] and doc["term"]["epoch"] == term["epoch"]
        assert [(m["name"], m["leads"]) for m in doc["members"]] == [(leader.name, True), (standby.name, False)]
        assert doc["group_state"] == "STABLE"
        # The newest heartbeat is the leader's, of the term the fence row shows.
        wait_for("a heartbeat", lambda: status_json(config)[1]["heartbeat"] is not None, 30)
        beat = status_json(config)[1]["heartbeat"]
        assert (beat["member"], beat["leader_id"]) == (leader.name, term["leader_id"])
        assert doc["heartbeat_timeout_seconds"] == 5.0
        # In flight as the leader's heartbeat reports it: nothing, once the backlog is drained.
        wait_for("in flight reported", lambda: status_json(config)[1]["in_flight_records"] == 0, 30)
        assert (doc["dead_letters"], doc["oldest_record_age_seconds"], doc["lag_seconds"]) == (1, None, 0.0)
        wait_for("its meter's lag in a heartbeat", lambda: status_json(config)[1]["heartbeat"]["lag_seconds"] == 0, 30)
        text = status(config)
        assert text.returncode == 0, text.stderr
        assert f"leader: {leader.name}; leader id {term['leader_id']}, epoch {term['epoch']}, since " in text.stdout
        assert f"  {leader.name}  host 127.0.0.1  leads\n  {standby.name}  host 127.0.0.1\n" in text.stdout

        # Hand over: the standby leads under the next epoch, and status names it.
        leader.proc.send_signal(signal.SIGTERM)
        assert leader.proc.wait(60) == 0, leader.output()
        wait_for("the standby to lead", lambda: status_json(config)[1]["leader"] == standby.name, 60)
        wait_for("the standby's term", lambda: bool(standby.events("fence_acquired")), 30)
        code, doc = status_json(config)
        assert code == 0
        assert doc["term"]["epoch"] == term["epoch"] + 1 == fence_acquired(standby)["epoch"]
        assert doc["term"]["leader_id"] == fence_acquired(standby)["leader_id"]
        assert [m["name"] for m in doc["members"]] == [standby.name]

        # Nobody left: exit 1, the last term still shown.
        standby.proc.send_signal(signal.SIGTERM)
        assert standby.proc.wait(60) == 0, standby.output()
        wait_for("an empty group", lambda: status_json(config)[0] == 1, 60)
        text = status(config)
        assert text.returncode == 1
        assert f"last term: leader id {fence_acquired(standby)['leader_id']}, epoch {term['epoch'] + 1}" in text.stdout
        assert "members: 0 (group empty)" in text.stdout
        assert f"from {standby.name}, leader id {fence_acquired(standby)['leader_id']}" in text.stdout
    finally:
        for r in reapers:
            r.kill()
        delete_topics(services.bootstrap, [f"{group}.neli"])


@pytest.mark.integration
def test_status_mistakes_are_one_line(services: Services, tmp_path: Path) -> None:
    config = tmp_path / "reaper.yaml"
    config.write_text("harvest:\n  outboxTabel: outbox\n")
    done = status(config)
    assert (done.returncode, done.stdout) == (2, "")
    unknown = "harvest.outboxTabel: unknown key (check its spelling and indentation)"
    assert done.stderr == f"reaper: configuration error: {config}: {unknown}\n"

    # Nothing listens on this port (in this suite's private range, unused by any fixture).
    config.write_text(
        goharvest_yaml(services, TableName(None, "outbox"), unique("g")).replace(services.bootstrap, "127.0.0.1:33098")
    )
    done = status(config, "--timeout", "2")
    assert (done.returncode, done.stdout) == (2, ""), done.stderr
    assert done.stderr.startswith("reaper: error: Kafka: cannot describe group ") and done.stderr.count("\n") == 1

    table = TableName(unique("absent"), "outbox")
    config.write_text(goharvest_yaml(services, table, unique("g")))
    done = status(config)
    assert (done.returncode, done.stdout) == (1, "")
    assert (
        done.stderr
        == f"reaper: error: harvest.outboxTable: outbox table {table} does not exist (run 'reaper migrate')\n"
    )


@pytest.mark.integration
def test_status_of_a_goharvest_table_never_migrated(
    services: Services, pg: psycopg.Connection[tuple[object, ...]], schema: str, tmp_path: Path
) -> None:
    # goharvest's own table: no fence table, no dead-letter table; nobody ever led it from here.
    table = TableName(schema, "outbox")
    create_goharvest_outbox(pg, table)
    config = tmp_path / "reaper.yaml"
    config.write_text(goharvest_yaml(services, table, unique("reaper-goharvest")))
    code, doc = status_json(config)
    assert code == 1
    assert (doc["leader"], doc["term"], doc["dead_letters"], doc["backlog_records"]) == (None, None, None, 0)
    text = status(config)
    assert text.returncode == 1
    assert "dead letters: none (no dead-letter table)" in text.stdout and "last term" not in text.stdout


@pytest.mark.unit
@pytest.mark.parametrize(("age", "warned"), [(0.4, False), (5.0, False), (7.5, True)])
def test_a_leader_without_recent_heartbeats_is_flagged(age: float, warned: bool) -> None:
    # A member can hold partition 0 after fencing itself (it cannot read its heartbeats back);
    # the group alone would call it the leader.
    report = Status(
        outbox_table="public.outbox",
        group="g",
        leader_topic="g.neli",
        delivery="at_least_once",
        group_state="STABLE",
        members=[Member(name="a", host="10.0.0.1", member_id="neli-a-1", leads=True)],
        leader="a",
        term=Term(leader_id="l1", epoch=3, since=datetime(2026, 1, 1, tzinfo=UTC)),
        heartbeat=Heartbeat(member="a", leader_id="l1", age_seconds=age),
        heartbeat_timeout_seconds=5.0,
        backlog_records=0,
        oldest_record_age_seconds=None,
        in_flight_records=0,
        dead_letters=None,
    )
    text = report.to_text()
    assert f"last heartbeat: {age:.1f} s ago, from a, leader id l1" in text
    assert ("warning: no heartbeat for more than harvest.limits.heartbeatTimeout (5 s): a may have" in text) is warned
    beat = {"member": "a", "leader_id": "l1", "age_seconds": age, "in_flight": None, "lag_seconds": None}
    assert json.loads(report.to_json())["heartbeat"] == beat


@pytest.mark.unit
def test_a_group_lookup_that_aborts_is_a_one_line_failure(monkeypatch: pytest.MonkeyPatch) -> None:
    # librdkafka can abort the process during a broker restart: only the lookup's child dies.
    from harvester.daemon import status_kafka
    from harvester.daemon.errors import FailError

    monkeypatch.setattr(status_kafka, "_lookup_group", lambda settings, timeout: os.abort())
    settings = SimpleNamespace(harvest=SimpleNamespace(group_id="g"))
    with pytest.raises(
        FailError, match=r"^Kafka: the lookup of group g ended without an answer: it was killed by signal 6"
    ) as failed:
        status_kafka.leader_group(settings, 5.0)  # type: ignore[arg-type]
    assert failed.value.code == 1  # a runtime failure: try again


@pytest.fixture
def silent_broker() -> Iterator[str]:
    """The address of a broker that accepts connections and answers nothing: a listening socket that
    never accepts, whose connections the kernel completes and nobody reads, which is all a client
    sees of a paused broker's (no JVM to start and pause)."""
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen(64)
        yield f"127.0.0.1:{listener.getsockname()[1]}"


@pytest.mark.integration
def test_a_group_lookup_that_times_out_is_a_one_line_failure(
    services: Services, silent_broker: str, tmp_path: Path
) -> None:
    # A broker that accepts connections and answers nothing (paused, as one stuck in a restart or a
    # long pause): the lookup times out; status says so in one line and exits 1, not 2 (the broker is
    # there) and not with a traceback.
    group = unique("g")
    config = tmp_path / "reaper.yaml"
    yaml = goharvest_yaml(services, TableName(None, "outbox"), group)
    config.write_text(yaml.replace(services.bootstrap, silent_broker))
    done = status(config, "--timeout", "2")
    assert (done.returncode, done.stdout) == (1, ""), done.stderr
    assert done.stderr == (
        f"reaper: error: Kafka: the lookup of group {group} at {silent_broker} timed out after 2 s"
        " (a broker restarting or overloaded?): try again, or raise --timeout\n"
    )

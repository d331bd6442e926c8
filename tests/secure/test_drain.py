"""The reaper drains through the secure services (verify-full TLS to PostgreSQL, SASL_SSL with SCRAM to
Kafka) as a runtime role made of ``reaper grants``' output alone and a principal with only the ACLs
docs/security.md lists; a second reaper takes over when the first stops."""

from __future__ import annotations

import time
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka.admin import AclOperation, ResourceType  # type: ignore[attr-defined]

from tests.secure import services as s
from tests.support.kafka import read_messages, text
from tests.support.reaper import run_reaper


def acls(group: str, topic: str, exactly_once: bool) -> list[s.Acl]:
    """The ACLs docs/security.md lists, found by running with nothing more."""
    rules = [
        s.Acl(ResourceType.TOPIC, topic, AclOperation.WRITE),
        s.Acl(ResourceType.TOPIC, f"{group}.neli", AclOperation.READ),
        s.Acl(ResourceType.TOPIC, f"{group}.neli", AclOperation.WRITE),
        s.Acl(ResourceType.GROUP, group, AclOperation.READ),
    ]
    if exactly_once:
        rules += [
            s.Acl(ResourceType.TOPIC, f"{group}.checkpoints", AclOperation.READ),
            s.Acl(ResourceType.TOPIC, f"{group}.checkpoints", AclOperation.WRITE),
            s.Acl(ResourceType.GROUP, f"{group}.checkpoints.recovery", AclOperation.READ),
            s.Acl(ResourceType.TRANSACTIONAL_ID, f"{group}.harvester", AclOperation.WRITE),
        ]
    return rules


def drained(table: str, procs: list[Any], timeout: float = 90) -> None:
    deadline = time.monotonic() + timeout
    while s.backlog(table):
        assert all(p.poll() is None for p in procs), "a reaper exited"
        assert time.monotonic() < deadline, f"{s.backlog(table)} records left"
        time.sleep(0.3)


@pytest.mark.parametrize(
    "harvest",
    [{}, {"source": "log"}, {"delivery": "exactly_once"}],
    ids=["polling", "log", "exactly_once"],
)
def test_drains_least_privileged_with_a_handover(secure: None, tmp_path: Path, harvest: dict[str, Any]) -> None:
    box = s.outbox(tmp_path, harvest)
    group = f"outbox-harvester.{box.table}"
    topic = f"out_{box.schema}"
    exactly_once = harvest.get("delivery") == "exactly_once"
    # Created by the administrator: the principal may not create topics.
    s.create_topics([topic, f"{group}.neli", *([f"{group}.checkpoints"] if exactly_once else [])])
    user = s.principal(acls(group, topic, exactly_once))
    kafka = s.kafka_config(user, s.PASSWORD)
    config = s.write(tmp_path / "reaper.yaml", box.table, s.pg_dsn(box.runtime, s.PASSWORD), kafka, harvest)
    check = run_reaper("check", "-f", str(config))
    assert check.returncode == 0, check.stdout + check.stderr
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first, second = (s.reaper_process(config, log) for log in logs)
    try:
        s.stash(box.table, 30, topic)
        drained(box.table, [first, second])
        # Whichever leads, stopping the first hands over to the second or leaves it leading.
        first.terminate()
        assert first.wait(60) == 0
        s.stash(box.table, 30, topic)
        drained(box.table, [second])
    finally:
        for p in (first, second):
            if p.poll() is None:
                p.terminate()
                p.wait(60)
    security = {k: v for k, v in s.kafka_config(**{"isolation.level": "read_committed"}).items()}
    got = read_messages(security.pop("bootstrap.servers"), [topic], 60, **security)
    values = sorted(int(text(m.value())[1:]) for m in got)
    assert values == sorted([*range(1, 31), *range(1, 31)])
    for log in logs:
        output = log.read_text()
        assert s.PASSWORD not in output
        assert '"level": "error"' not in output and '"level": "critical"' not in output, output[-3000:]

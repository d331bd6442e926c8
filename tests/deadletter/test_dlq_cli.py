"""``reaper dlq`` list/show/replay/purge through the console script, with confirmation prompts."""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
import yaml
from psycopg import sql

from harvester import PostgresStore
from harvester.core.records import Failure
from harvester.postgres.identifiers import TableName
from tests.engine.workload import insert
from tests.support import Services

pytestmark = pytest.mark.integration


def reaper(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-m", "harvester.daemon.cli", *args, "-f", str(config)],
        check=False,
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=60,
    )


def test_dlq_commands(services: Services, outbox: TableName, tmp_path: Path) -> None:
    insert(services.pg_dsn, outbox, [("t", "k", f"k:{i}") for i in range(3)])
    store = PostgresStore.open(services.pg_dsn, outbox)
    leader = uuid.uuid4()
    store.acquire(leader)
    marked = store.mark(leader, 10)
    store.dead_letter([Failure(r.id, r.key, "msg_size_too_large", "too big", 3, None) for r in marked], leader)
    store.close()
    ids = [r.id for r in marked]
    config = tmp_path / "reaper.yaml"
    config.write_text(yaml.safe_dump({"harvest": {"dataSource": services.pg_dsn, "outboxTable": outbox.qualified}}))

    listed = reaper(config, "dlq", "list")
    assert listed.returncode == 0, listed.stderr
    assert "3 dead letter(s)" in listed.stdout and "reason=msg_size_too_large" in listed.stdout
    assert "k:0" not in listed.stdout  # values are not listed

    shown = reaper(config, "dlq", "show", str(ids[0]))
    assert shown.returncode == 0 and json.loads(shown.stdout)["kafka_value"] == "k:0"
    assert reaper(config, "dlq", "show", "999999").returncode == 1

    refused = reaper(config, "dlq", "replay", str(ids[0]))  # no terminal and no --yes: nothing happens
    assert refused.returncode == 1 and "--yes" in refused.stderr
    assert reaper(config, "dlq", "replay").returncode == 2

    replayed = reaper(config, "dlq", "replay", str(ids[2]), str(ids[0]), "--yes")
    assert replayed.returncode == 0, replayed.stderr
    with psycopg.connect(services.pg_dsn) as conn:
        rows = conn.execute(sql.SQL("SELECT id, kafka_value FROM {} ORDER BY id").format(outbox.ident)).fetchall()
    assert [r[1] for r in rows] == ["k:0", "k:2"]  # original order kept, new ids
    assert all(r[0] > max(ids) for r in rows)

    future = (datetime.now(UTC) + timedelta(minutes=1)).isoformat()
    purged = reaper(config, "dlq", "purge", "--before", future, "--yes")
    assert purged.returncode == 0 and "purged 1 dead letter(s)" in purged.stdout
    assert reaper(config, "dlq", "purge", "--before", "yesterday", "--yes").returncode == 2

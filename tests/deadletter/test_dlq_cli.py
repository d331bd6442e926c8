"""``reaper dlq`` list/show/replay/purge through the console script, with confirmation prompts."""

from __future__ import annotations

import json
import subprocess
import uuid
from datetime import UTC, datetime, timedelta
from pathlib import Path

import psycopg
import pytest
import yaml
from psycopg import sql

from harvester import PostgresStore
from harvester.core.records import Failure
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import insert
from tests.support.postgres import create_goharvest_outbox
from tests.support.reaper import run_reaper
from tests.support.services import Services

pytestmark = pytest.mark.integration


def reaper(config: Path, *args: str) -> subprocess.CompletedProcess[str]:
    return run_reaper(*args, "-f", str(config))


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


@pytest.mark.unit
@pytest.mark.parametrize("count", ["-5", "0", "ten"])
def test_dlq_list_refuses_a_count_below_one(tmp_path: Path, count: str) -> None:
    # Refused by the argument parser, before the configuration is read or anything is connected.
    done = reaper(tmp_path / "unused.yaml", "dlq", "list", "-n", count)
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "Traceback" not in done.stderr
    assert done.stderr.startswith("reaper dlq list: error: argument -n/--limit: ")
    assert done.stdout == ""


@pytest.mark.unit
def test_every_dlq_action_has_help_and_a_description() -> None:
    def helped(*args: str) -> str:
        done = run_reaper(*args, "--help")
        assert done.returncode == 0, done.stderr
        return done.stdout

    overview = helped("dlq")
    for action in ("list", "show", "replay", "purge"):
        summary = next(line for line in overview.splitlines() if line.strip().startswith(action))
        assert len(summary.split()) > 2, summary  # the action and its help line
        text = helped("dlq", action)
        # usage (one or more lines), a blank line, then a description paragraph before the options
        lines = text.splitlines()
        assert not lines[lines.index("") + 1].startswith(("options:", "positional")), text


def test_dlq_without_a_dead_letter_table_says_so(
    services: Services, pg: psycopg.Connection[tuple[object, ...]], schema: str, tmp_path: Path
) -> None:
    # A goharvest table, never migrated and with nothing dead-lettered: no dead-letter table.
    outbox = TableName(schema, "outbox")
    create_goharvest_outbox(pg, outbox)
    config = tmp_path / "reaper.yaml"
    config.write_text(yaml.safe_dump({"harvest": {"dataSource": services.pg_dsn, "outboxTable": outbox.qualified}}))
    actions = {
        "list": (["list"], "nothing to list"),
        "show": (["show", "1"], "nothing to show"),
        "replay": (["replay", "--all", "--yes"], "nothing replayed"),
        "purge": (["purge", "--before", "2100-01-01", "--yes"], "nothing purged"),
    }
    for args, outcome in actions.values():
        done = reaper(config, "dlq", *args)
        assert done.returncode == 1, (args, done.stdout, done.stderr)
        assert done.stdout == "" and "dead letter(s)" not in done.stderr
        assert done.stderr == (
            f"reaper: error: dead-letter table {schema}.outbox_dead_letter does not exist (no record was ever "
            f"dead-lettered, and 'reaper migrate' was not run); {outcome}\n"
        )
    exists = pg.execute("SELECT to_regclass(%s)", (f"{schema}.outbox_dead_letter",)).fetchone()
    assert exists == (None,)  # nothing was created on the way

    # An outbox table that does not exist at all is named as such.
    config.write_text(yaml.safe_dump({"harvest": {"dataSource": services.pg_dsn, "outboxTable": f"{schema}.nope"}}))
    missing = reaper(config, "dlq", "list")
    assert missing.returncode == 1
    assert missing.stderr == (
        f"reaper: error: harvest.outboxTable: outbox table {schema}.nope does not exist (run 'reaper migrate')\n"
    )


def test_dlq_replay_of_ids_that_are_not_dead_letters_changes_nothing(
    services: Services, outbox: TableName, tmp_path: Path
) -> None:
    config = tmp_path / "reaper.yaml"
    config.write_text(yaml.safe_dump({"harvest": {"dataSource": services.pg_dsn, "outboxTable": outbox.qualified}}))
    listed = reaper(config, "dlq", "list")  # migrated: the dead-letter table exists, empty
    assert (listed.returncode, listed.stdout) == (0, f"0 dead letter(s) in {outbox.schema}.outbox_dead_letter\n")
    done = reaper(config, "dlq", "replay", "424242", "--yes")
    assert done.returncode == 1
    assert done.stderr == (
        f"reaper: error: no dead letter with id(s) 424242 in {outbox.schema}.outbox_dead_letter; nothing replayed\n"
    )

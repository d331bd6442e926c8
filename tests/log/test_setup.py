"""``reaper migrate`` creates the log source's publication and slot; ``reaper check`` names what is
missing, with the fix; ``hold_key`` with the log source is refused in one line."""

from __future__ import annotations

import json
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harvester import HarvesterConfig
from harvester.daemon import logs
from harvester.daemon.cli import main
from harvester.postgres.schema.identifiers import TableName
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    yield
    logs.reset()


@pytest.fixture
def fresh_table(logical_dsn: str) -> Iterator[TableName]:
    """A table name in a schema of its own; its slot, publication and schema are removed afterwards."""
    schema = unique("t")
    table = TableName(schema, "outbox")
    yield table
    config = HarvesterConfig(outbox_table=table.qualified)
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        conn.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                     (config.slot,))  # fmt: skip
        conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(config.publication)))
        conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))


def write_config(tmp_path: Path, dsn: str, services: Services, table: TableName, extra: str = "") -> str:
    path = tmp_path / "reaper.yaml"
    path.write_text(
        f"harvest:\n  dataSource: '{dsn}'\n  outboxTable: {table}\n  source: log\n"
        f"  baseKafkaConfig:\n    bootstrap.servers: {services.bootstrap}\n{extra}"
    )
    return str(path)


def test_migrate_creates_publication_and_slot_and_check_agrees(
    services: Services, logical_dsn: str, fresh_table: TableName, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = write_config(tmp_path, logical_dsn, services, fresh_table)
    config = HarvesterConfig(outbox_table=fresh_table.qualified)
    assert main(["check", "-f", path]) == 1
    assert f"outbox table {fresh_table}: absent" in capsys.readouterr().out
    assert main(["migrate", "-f", path]) == 0
    out = capsys.readouterr().out
    assert f"log source: created publication {config.publication}" in out
    assert f"log source: created replication slot {config.slot}" in out
    assert main(["migrate", "-f", path]) == 0
    assert "log source: created" not in capsys.readouterr().out
    assert main(["check", "-f", path]) == 0, capsys.readouterr().out
    assert f"log source: slot {config.slot}, publication {config.publication}: ready" in capsys.readouterr().out

    # 'reaper status' shows the slot: behind by the row written since, and nobody streaming it.
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL("INSERT INTO {} (kafka_topic, kafka_key, kafka_value) VALUES ('t', 'k', 'v')").format(
                fresh_table.ident
            )
        )
    assert main(["status", "-f", path, "--json"]) == 1  # nobody leads
    slot = json.loads(capsys.readouterr().out)["slot"]
    assert slot["name"] == config.slot and slot["streaming"] is False
    assert 0 < slot["lag_bytes"] <= slot["retained_bytes"]
    assert main(["status", "-f", path]) == 1
    line = next(x for x in capsys.readouterr().out.splitlines() if x.startswith(f"log slot {config.slot}: lag "))
    assert line.endswith("byte(s) of WAL, no reader attached")

    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("DROP PUBLICATION {}").format(sql.Identifier(config.publication)))
    assert main(["check", "-f", path]) == 1
    out = capsys.readouterr().out
    assert f"problem: log source: publication {config.publication} does not exist: run 'reaper migrate'" in out


def test_check_names_a_role_without_replication(
    services: Services, logical_dsn: str, fresh_table: TableName, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    role, schema = unique("r"), str(fresh_table.schema)
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD 'role-secret'").format(sql.Identifier(role)))
        conn.execute(
            sql.SQL("GRANT CREATE ON DATABASE {} TO {}").format(sql.Identifier(conn.info.dbname), sql.Identifier(role))
        )
    try:
        dsn = make_conninfo(logical_dsn, user=role, password="role-secret")
        path = write_config(tmp_path, dsn, services, fresh_table)
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(
                sql.Identifier(schema), sql.Identifier(role)))  # fmt: skip
        assert main(["migrate", "-f", path]) == 1
        err = capsys.readouterr().err
        assert f"may not read replication slots: ALTER ROLE {role} REPLICATION" in err
        assert err.count("\n") == 1
        assert main(["check", "-f", path]) == 1
        assert f"problem: log source: role {role} may not read replication slots" in capsys.readouterr().out
    finally:
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            conn.execute(sql.SQL("DROP OWNED BY {}").format(sql.Identifier(role)))
            conn.execute(sql.SQL("DROP ROLE {}").format(sql.Identifier(role)))


@pytest.mark.unit
def test_held_dead_letter_keys_with_the_log_source_are_refused(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    path = tmp_path / "reaper.yaml"
    path.write_text("harvest:\n  source: log\n  deadLetterPolicy: hold_key\n")
    assert main(["run", "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert "source 'log' does not support deadLetterPolicy 'hold_key'" in err and err.count("\n") == 1


def test_migrate_and_check_a_table_less_outbox(
    services: Services, logical_dsn: str, fresh_table: TableName, tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    """No outbox table: 'reaper migrate' creates the fence and dead-letter tables, an empty
    publication and the slot; 'reaper check' and 'reaper status' need no table. On this single server
    a failover would lose records: 'reaper check' and 'reaper run' refuse, in one line naming the risk
    and the setting, until logAcceptLossOnFailover says so."""
    path = write_config(tmp_path, logical_dsn, services, fresh_table, "  logMessages: true\n")
    config = HarvesterConfig(outbox_table=fresh_table.qualified)
    assert main(["check", "-f", path]) == 1
    out = capsys.readouterr().out
    assert f"problem: log source: replication slot {config.slot} does not exist: run 'reaper migrate'" in out
    assert main(["migrate", "-f", path]) == 0
    out = capsys.readouterr().out
    assert f"table-less outbox {fresh_table}: applied 0003_fence" in out
    assert f"log source: created publication {config.publication} (empty" in out
    risk = "a failover would lose the table-less outbox's records not yet delivered"
    setting = "set harvest.logAcceptLossOnFailover: true to run anyway"
    assert main(["check", "-f", path]) == 1
    [line] = [line for line in capsys.readouterr().out.splitlines() if line.startswith("problem:")]
    assert risk in line and setting in line, line
    assert main(["run", "-f", path]) == 2
    err = capsys.readouterr().err
    assert risk in err and setting in err and err.count("\n") == 1, err
    accepted = "  logMessages: true\n  logAcceptLossOnFailover: true\n"
    path = write_config(tmp_path, logical_dsn, services, fresh_table, accepted)
    assert main(["check", "-f", path]) == 0, capsys.readouterr().out
    out = capsys.readouterr().out
    assert f"log source: slot {config.slot}, publication {config.publication}: ready" in out
    assert "log source: a failover loses the records not yet delivered (harvest.logAcceptLossOnFailover)" in out
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        row = conn.execute("SELECT to_regclass(%s)", (fresh_table.quoted,)).fetchone()
    assert row == (None,)  # no table
    assert main(["status", "-f", path, "--json"]) == 1  # nobody leads
    assert json.loads(capsys.readouterr().out)["slot"]["name"] == config.slot


@pytest.mark.unit
def test_a_sharded_table_less_outbox_is_refused(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "reaper.yaml"
    path.write_text("harvest:\n  source: log\n  logMessages: true\n  shards: 2\n")
    assert main(["run", "-f", str(path)]) == 2
    err = capsys.readouterr().err
    assert "does not support shards > 1" in err and err.count("\n") == 1

"""The reaper command line: help, version, migrate, check, and configuration mistakes (exit 2, one line)."""

from __future__ import annotations

import subprocess
import sys
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from harvester.daemon.cli import main
from harvester.postgres.schema.identifiers import TableName
from tests.support.names import unique
from tests.support.postgres import create_goharvest_outbox
from tests.support.services import Services

REAPER = str(Path(sys.executable).parent / "reaper")
PG_SECRET = "Pg-Cli-S3cret"


def reaper(*args: str, timeout: float = 60) -> subprocess.CompletedProcess[str]:
    return subprocess.run([REAPER, *args], capture_output=True, text=True, timeout=timeout, check=False)


def config(tmp_path: Path, text: str) -> str:
    path = tmp_path / "reaper.yaml"
    path.write_text(text)
    return str(path)


@pytest.fixture(autouse=True)
def _no_reaper_env(monkeypatch: pytest.MonkeyPatch) -> None:
    import os

    for name in list(os.environ):
        if name.startswith("REAPER_"):
            monkeypatch.delenv(name)


# ------------------------------------------------------------------------------------------ unit


@pytest.mark.unit
def test_version_from_the_console_script() -> None:
    done = reaper("--version")
    assert done.returncode == 0
    assert done.stdout.startswith("reaper (outbox-harvester) ")


@pytest.mark.unit
def test_help_explains_commands_and_configuration(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as info:
        main(["--help"])
    assert info.value.code == 0
    text = capsys.readouterr().out
    for word in ("run", "migrate", "check", "-f reaper.yaml", "REAPER_HARVEST__DATA_SOURCE", "${file:", "exit codes"):
        assert word in text


@pytest.mark.unit
def test_no_arguments_prints_help_and_exits_2(capsys: pytest.CaptureFixture[str]) -> None:
    assert main([]) == 2
    assert "usage: reaper" in capsys.readouterr().err


BAD_CONFIGS = {
    "unknown key": ("harvest:\n  leaderGroupId2: x\n", "harvest.leaderGroupId2: unknown key"),
    "bad duration": ("harvest:\n  limits:\n    heartbeatTimeout: 5 sec\n", "harvest.limits.heartbeatTimeout"),
    "negative limit": ("harvest:\n  limits:\n    markQueryRecords: -10\n", "harvest.limits.markQueryRecords"),
    "bad table": ('harvest:\n  outboxTable: "out box"\n', "harvest.outboxTable: invalid table name"),
    "kafka property": (
        "harvest:\n  producerKafkaConfig:\n    compresion.type: lz4\n",
        "No such configuration property",
    ),
    "kafka value": ("harvest:\n  producerKafkaConfig:\n    acks: sometimes\n", "acks"),
}


@pytest.mark.unit
@pytest.mark.parametrize(
    ("command", "case"),
    # migrate never talks to Kafka, so it does not look at Kafka properties.
    [(c, k) for c in ("run", "check", "migrate") for k in sorted(BAD_CONFIGS) if c != "migrate" or "kafka" not in k],
)
def test_bad_configuration_exits_2_with_one_line(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], command: str, case: str
) -> None:
    text, expected = BAD_CONFIGS[case]
    code = main([command, "-f", config(tmp_path, text)])
    err = capsys.readouterr().err
    assert code == 2
    assert err.count("\n") == 1 and err.startswith("reaper: ")
    assert expected in err
    assert "Traceback" not in err


@pytest.mark.unit
def test_limits_the_election_refuses_exit_2(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = config(tmp_path, "harvest:\n  dataSource: host=127.0.0.1 port=1\n  limits:\n    minPollInterval: 2s\n")
    assert main(["run", "-f", path]) == 2
    err = capsys.readouterr().err
    expected = "reaper: error: harvest.limits: minPollInterval must not exceed the election's heartbeat interval (1 s)"
    expected += "\n"
    assert err == expected
    # check refuses the same file with the same words, before reaching any service.
    assert main(["check", "-f", path]) == 2
    assert capsys.readouterr().err == expected


@pytest.mark.unit
def test_a_spill_directory_that_takes_no_file_is_refused_at_start(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], monkeypatch: pytest.MonkeyPatch
) -> None:
    """The log source's spill directory is tried before anything starts, by run and check alike: a
    large transaction would otherwise fail its leader in the middle of a drain."""
    text = "harvest:\n  dataSource: host=127.0.0.1 port=1\n  source: log\n  logSpillDirectory: /nonexistent\n"
    path = config(tmp_path, text)
    expected = "reaper: error: harvest.logSpillDirectory: cannot make a file in /nonexistent: No such file or directory"
    expected += "\n"
    for command in ("run", "check"):
        assert main([command, "-f", path]) == 2
        assert capsys.readouterr().err == expected
    (tmp_path / "file").write_text("")
    monkeypatch.setenv("REAPER_HARVEST__LOG_SPILL_DIRECTORY", str(tmp_path / "file"))
    assert main(["check", "-f", path]) == 2
    assert capsys.readouterr().err.endswith(f"cannot make a file in {tmp_path}/file: Not a directory\n")


@pytest.mark.integration
def test_run_with_postgres_unreachable_exits_2(
    tmp_path: Path, capsys: pytest.CaptureFixture[str], services: Services
) -> None:
    # Kafka is the suite's, reachable (the reaper tries it first): the database is what fails.
    dsn = f"host=127.0.0.1 port=1 user=u password={PG_SECRET} dbname=d"
    kafka = f"  baseKafkaConfig:\n    bootstrap.servers: {services.bootstrap}\n"
    path = config(tmp_path, f"harvest:\n  dataSource: {dsn}\n{kafka}http:\n  port: 0\n")
    assert main(["run", "-f", path]) == 2
    captured = capsys.readouterr()
    assert captured.err.splitlines()[-1].startswith("reaper: error: PostgreSQL (harvest.dataSource")
    assert PG_SECRET not in captured.out + captured.err


@pytest.mark.unit
def test_goharvest_command_line_with_a_bad_file(tmp_path: Path) -> None:
    # goharvest users type "reaper -f reaper.yaml"; a mistake is one line and exit 2, no traceback.
    path = config(tmp_path, "harvest:\n  limits:\n    queueTimeout: forever\n")
    done = reaper("-f", path)
    assert done.returncode == 2
    assert done.stderr.strip() == (
        f"reaper: configuration error: {path}: harvest.limits.queueTimeout: invalid duration 'forever': "
        "use forms like '100ms', '5s', '1m30s'"
    )
    missing = reaper("-f", str(tmp_path / "nope.yaml"))
    assert missing.returncode == 2 and "no such configuration file" in missing.stderr
    assert missing.stderr.count("\n") == 1


# ------------------------------------------------------------------------------------------ integration


def yaml_for(
    services: Services, table: TableName, topic: str, *, dsn: str | None = None, kafka: str | None = None
) -> str:
    data_source = dsn or services.pg_dsn.replace("password=local-dev-secret", f"password={PG_SECRET}")
    return (
        "harvest:\n"
        f"  dataSource: {data_source}\n"
        f"  outboxTable: {table.qualified}\n"
        f"  leaderTopic: {topic}\n"
        f"  leaderGroupID: {topic}\n"
        "  baseKafkaConfig:\n"
        f"    bootstrap.servers: '{kafka or services.bootstrap}'\n"
    )


@pytest.mark.integration
def test_migrate_is_idempotent_and_keeps_existing_rows(
    services: Services, pg: psycopg.Connection[tuple[object, ...]], schema: str, tmp_path: Path
) -> None:
    table = TableName(schema, "outbox")
    # A goharvest-created table with data in it already.
    create_goharvest_outbox(pg, table)
    pg.execute(
        sql.SQL(
            "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, "
            "kafka_header_values) VALUES (now(), 't', 'k', 'v', '{{}}', '{{}}')"
        ).format(table.ident)
    )
    path = config(tmp_path, yaml_for(services, table, unique("lead")))
    first = reaper("migrate", "-f", path)
    assert first.returncode == 0, first.stderr
    assert first.stdout.startswith(f"outbox table {table}: applied 0001_outbox, 0002_notify")
    second = reaper("migrate", "-f", path)
    assert (second.returncode, second.stdout) == (0, f"outbox table {table}: up to date\n")
    rows = pg.execute(sql.SQL("SELECT kafka_key, kafka_value FROM {}").format(table.ident)).fetchall()
    assert rows == [("k", "v")]
    assert PG_SECRET not in first.stdout + first.stderr + second.stdout + second.stderr


@pytest.mark.integration
def test_check_reports_what_it_found(
    services: Services, outbox: TableName, topics: Callable[..., str], tmp_path: Path
) -> None:
    leader_topic = topics()
    done = reaper("check", "-f", config(tmp_path, yaml_for(services, outbox, leader_topic)))
    assert done.returncode == 0, done.stdout + done.stderr
    out = done.stdout
    assert "postgres: reachable; server 1" in out
    assert f"outbox table {outbox}: present; kafka_key varchar(100), kafka_value varchar(10000)" in out
    assert "kafka: reachable; 1 broker(s)" in out
    assert f"leader topic {leader_topic}: present, 1 partition(s)" in out
    assert out.rstrip().endswith("configuration ok")
    assert PG_SECRET not in out + done.stderr

    absent = reaper("check", "-f", config(tmp_path, yaml_for(services, TableName(outbox.schema, "nope"), "absent-t")))
    assert absent.returncode == 1
    assert f"outbox table {outbox.schema}.nope: absent" in absent.stdout
    assert "leader topic absent-t: absent" in absent.stdout


@pytest.mark.integration
def test_check_names_the_connection_settings_left_to_their_defaults(
    services: Services, outbox: TableName, tmp_path: Path
) -> None:
    # An empty file (a broken ConfigMap) runs on the defaults, and check says which, before connecting.
    out = reaper("check", "-f", config(tmp_path, "")).stdout
    default_dsn = "host=127.0.0.1 port=5432 user=harvester dbname=harvester"
    assert f"note: harvest.dataSource ({default_dsn}) is not set: using the default" in out
    assert "note: harvest.baseKafkaConfig (bootstrap.servers: 127.0.0.1:9092) is not set: using the default" in out
    assert "password" not in out  # no default carries a secret
    assert "note:" not in reaper("check", "-f", config(tmp_path, yaml_for(services, outbox, "t"))).stdout


@pytest.mark.integration
@pytest.mark.parametrize("service", ["postgres", "kafka"])
def test_check_unreachable_service_exits_2(services: Services, outbox: TableName, tmp_path: Path, service: str) -> None:
    dsn = f"host=127.0.0.1 port=1 user=harvester password={PG_SECRET} dbname=harvester"
    path = config(
        tmp_path,
        yaml_for(
            services,
            outbox,
            "t",
            dsn=dsn if service == "postgres" else None,
            kafka="127.0.0.1:1" if service == "kafka" else None,
        ),
    )
    done = reaper("check", "--timeout", "2", "-f", path)
    assert done.returncode == 2
    line = done.stderr.strip()
    assert "\n" not in line and "Traceback" not in line
    if service == "postgres":
        assert line.startswith("reaper: error: PostgreSQL: cannot connect (harvest.dataSource): ")
    else:
        assert line == (
            "reaper: error: Kafka unreachable at 127.0.0.1:1 (harvest.baseKafkaConfig: bootstrap.servers): "
            "Connect to ipv4#127.0.0.1:1 failed: Connection refused"
        )
    assert PG_SECRET not in done.stdout + done.stderr

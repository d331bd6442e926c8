"""docs/writers.md, proven: each writer shape it shows (goharvest's stasher's statement, a psql script, a
prepared statement with an explicit create_time) writes an outbox that a ``reaper -f reaper.yaml``
configured like goharvest's example drains, record for record; and its DDL is the first migration's."""

from __future__ import annotations

import re
import signal
import subprocess
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from harvester.daemon.cli import main
from tests.support.kafka import consumed_headers, read_messages
from tests.support.names import unique
from tests.support.paths import ROOT
from tests.support.ports import free_ports
from tests.support.reaper import REAPER, reaper_environment, run_reaper
from tests.support.services import Services

DOC = (ROOT / "docs" / "writers.md").read_text()
IDENTITY = ["outbox-id", "outbox-epoch", "outbox-producer"]


def block(name: str) -> str:
    """The fenced block that follows ``<!-- writers: name -->`` in docs/writers.md."""
    found = re.search(rf"<!-- writers: {name} -->\n```sql\n(.*?)```", DOC, re.DOTALL)
    assert found, f"docs/writers.md has no '{name}' block"
    return found.group(1)


@pytest.mark.unit
def test_the_documented_ddl_is_the_first_migration() -> None:
    migration = (ROOT / "sql" / "0001_outbox.sql").read_text()
    statement = migration[migration.index("CREATE TABLE") :].replace("${table}", "outbox")
    assert block("ddl") == statement


def pq_array(items: list[str]) -> str:
    """A text array literal as lib/pq's ``pq.Array`` sends a ``[]string``: every element quoted, quotes
    and backslashes escaped; ``{}`` when empty."""
    return "{" + ",".join('"' + s.replace("\\", "\\\\").replace('"', '\\"') + '"' for s in items) + "}"


def goharvest_reaper_yaml(services: Services, schema: str, group: str) -> str:
    """goharvest's examples/reaper.yaml (and its README's), pointed at the test's services and table.
    ``maxPollInterval`` is what goharvest derives from ``heartbeatTimeout: 5s`` when it is left out
    (half of it), written out: this reaper raises it to the election's session timeout, with a warning."""
    return f"""\
harvest:
  baseKafkaConfig:
    bootstrap.servers: {services.bootstrap}
  producerKafkaConfig:
    compression.type: lz4
    delivery.timeout.ms: 10000
  leaderTopic: {group}
  leaderGroupID: {group}
  dataSource: {services.pg_dsn}
  outboxTable: {schema}.outbox
  limits:
    minPollInterval: 1s
    heartbeatTimeout: 5s
    maxInFlightRecords: 1000
    minMetricsInterval: 5s
    sendConcurrency: 4
    sendBuffer: 10
    maxPollInterval: 2500ms
logging:
  level: Debug
"""


@pytest.mark.integration
def test_writer_shapes_drained_by_a_reaper_configured_like_goharvests_example(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    topics: Callable[..., str],
    tmp_path: Path,
    capsys: pytest.CaptureFixture[str],
) -> None:
    topic, group = topics(), unique("writers")
    config = tmp_path / "reaper.yaml"
    config.write_text(goharvest_reaper_yaml(services, schema, group))
    migrated = run_reaper("migrate", "-f", str(config))
    assert migrated.returncode == 0, migrated.stderr
    assert main(["check", "-f", str(config)]) == 0
    note = "note: harvest.limits.maxPollInterval (2.5s) is below the election's session timeout: using 10s"
    assert note in capsys.readouterr().out
    pg.execute(sql.SQL("SET search_path TO {}").format(sql.Identifier(schema)))

    # 1. goharvest's stasher: Stash (one statement per record) and Prepare + PreStash.Stash (a prepared
    # statement per transaction), with lib/pq's placeholders and array literals, NULL for a nil value.
    stasher = block("goharvest-stasher")
    with pg.transaction():
        cur = psycopg.RawCursor(pg)
        cur.execute(stasher, (topic, "go-a", "first", pq_array(["source"]), pq_array(["go"])))
        cur.execute(stasher, (topic, "go-a", None, pq_array([]), pq_array([])))
    with pg.transaction():
        cur = psycopg.RawCursor(pg)
        cur.execute(stasher, (topic, "go-b", "p1", pq_array(["a", "b"]), pq_array(["1", 'say "hi"\\'])), prepare=True)
        cur.execute(stasher, (topic, "go-b", "p2", pq_array([]), pq_array([])), prepare=True)

    # 2. The psql script, as the page says to run it.
    script = tmp_path / "outbox.sql"
    script.write_text(block("psql"))
    psql = Path(subprocess.check_output(["bash", str(ROOT / "deploy/local/services.sh"), "pg-bindir"], text=True))
    env = {**reaper_environment(), "PGOPTIONS": f"-c search_path={schema}"}
    argv = [str(psql / "psql"), "-X", "-q", "-v", "ON_ERROR_STOP=1", "-v", f"topic={topic}", "-f", str(script)]
    done = subprocess.run([*argv, services.pg_dsn], env=env, capture_output=True, text=True, timeout=30, check=False)
    assert done.returncode == 0, done.stderr

    # 3. A prepared statement with an explicit create_time, the later row with the earlier time.
    for statement in block("prepared").replace("'orders'", f"'{topic}'").split(";\n"):
        if statement.strip():
            pg.execute(statement)  # autocommit: each EXECUTE commits on its own

    expected: dict[str, list[tuple[str | None, list[tuple[str, str | None]]]]] = {
        "go-a": [("first", [("source", "go")]), (None, [])],
        "go-b": [("p1", [("a", "1"), ("b", 'say "hi"\\')]), ("p2", [])],
        "order-7": [
            ('{"status":"paid"}', [("content-type", "application/json")]),
            # a NULL header value is published empty
            ('{"status":"shipped"}', [("content-type", "application/json"), ("note", "")]),
        ],
        "order-8": [(None, [])],
        "order-9": [("created", [("source", "billing")]), ("paid", [])],
    }
    total = sum(len(v) for v in expected.values())
    port = free_ports(1)
    with (tmp_path / "reaper.log").open("w") as log:
        reaper = subprocess.Popen(
            [*REAPER, "-f", str(config)],  # goharvest's command line
            stdout=log,
            stderr=subprocess.STDOUT,
            env=reaper_environment(REAPER_HTTP__PORT=str(port), REAPER_HTTP__HOST="127.0.0.1"),
            cwd=ROOT,
        )
    try:
        messages = read_messages(services.bootstrap, [topic], total, timeout=90)
    finally:
        reaper.send_signal(signal.SIGTERM)
        code = reaper.wait(60)
    output = (tmp_path / "reaper.log").read_text()
    assert code == 0, output[-3000:]
    assert "max_poll_interval_raised" in output

    got: dict[str, list[tuple[str | None, list[tuple[str, str | None]]]]] = {}
    ids: dict[str, list[int]] = {}
    for msg in messages:
        key = (msg.key() or b"").decode()
        value = msg.value()
        headers = [(k, None if v is None else v.decode()) for k, v in consumed_headers(msg) or []]
        assert [k for k, _ in headers[-3:]] == IDENTITY, headers
        got.setdefault(key, []).append((None if value is None else value.decode(), headers[:-3]))
        ids.setdefault(key, []).append(int(str(headers[-3][1])))
    assert got == expected
    assert all(seq == sorted(seq) for seq in ids.values()), ids  # id order per key, whatever create_time says
    remaining = pg.execute(sql.SQL("SELECT count(*) FROM {}.outbox").format(sql.Identifier(schema))).fetchone()
    assert remaining == (0,)

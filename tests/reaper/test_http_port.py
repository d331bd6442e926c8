"""Several reapers on one host (goharvest's failover set-up, issue 18): a defaulted ``http.port`` that is
busy falls back to a free port; an ``http.port`` the user set is used or refused (exit 2)."""

from __future__ import annotations

import json
import signal
import socket
import subprocess
import time
import urllib.error
import urllib.request
from collections.abc import Callable, Mapping
from pathlib import Path
from typing import Any

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harvester.daemon.loading import load
from harvester.daemon.settings import DEFAULT_HTTP_PORT
from harvester.postgres.schema.identifiers import TableName
from tests.reaper.test_e2e import insert, outbox_count, wait_for
from tests.support.kafka import delete_topics, read_messages
from tests.support.names import unique
from tests.support.paths import ROOT
from tests.support.reaper import REAPER, reaper_environment, run_reaper
from tests.support.services import Services

STAY_UP = 15.0  # seconds every reaper must keep running


def goharvest_yaml(services: Services, table: TableName, group: str) -> str:
    """A goharvest reaper.yaml as its users have it: no `http:` section (goharvest has no HTTP server)."""
    return f"""\
harvest:
  baseKafkaConfig:
    bootstrap.servers: {services.bootstrap}
  producerKafkaConfig:
    delivery.timeout.ms: 10000
  leaderTopic: {group}.neli
  leaderGroupID: {group}
  dataSource: {services.pg_dsn}
  outboxTable: {table.qualified}
  limits:
    minPollInterval: 100ms
    heartbeatTimeout: 5s
    maxInFlightRecords: 1000
    minMetricsInterval: 1s
logging:
  level: Info
"""


# --- what counts as "set": the settings alone -------------------------------------------------------


@pytest.mark.unit
@pytest.mark.parametrize(
    ("text", "env", "explicit"),
    [
        (None, {}, False),
        ("logging:\n  level: info\n", {}, False),
        ("http:\n  host: 127.0.0.1\n", {}, False),
        ("http:\n  enabled: true\n", {}, False),
        ("http:\n  port: 9090\n", {}, True),  # the default's value, but chosen
        ("http:\n  port: 0\n", {}, True),
        ("http: {port: 9191, host: 127.0.0.1}\n", {}, True),
        (None, {"REAPER_HTTP__PORT": "9090"}, True),
        ("http:\n  host: 127.0.0.1\n", {"REAPER_HTTP__PORT": "9191"}, True),
        ("http:\n  port: 9191\n", {"REAPER_HTTP__PORT": "9192"}, True),
        (None, {"REAPER_HTTP__HOST": "127.0.0.1", "REAPER_HTTP__ENABLED": "true"}, False),
        (None, {"REAPER_LOGGING__LEVEL": "warn"}, False),
    ],
)
def test_an_explicit_port_is_told_from_a_defaulted_one(
    tmp_path: Path, text: str | None, env: Mapping[str, str], explicit: bool
) -> None:
    path: Path | None = None
    if text is not None:
        path = tmp_path / "reaper.yaml"
        path.write_text(text)
    settings = load(path, environ=env)
    assert settings.http_port_explicit is explicit
    if not explicit:
        assert settings.http.port == DEFAULT_HTTP_PORT


# --- through the real CLI ----------------------------------------------------------------------------


class Process:
    """One `python -m harvester.daemon.cli -f reaper.yaml`, its JSON log lines and its HTTP endpoints."""

    def __init__(self, config: Path, name: str, logs: Path) -> None:
        self.name = name
        self.stderr = logs / f"{name}.err"
        self.stdout = logs / f"{name}.out"
        env = reaper_environment(REAPER_HARVEST__NAME=name)  # the instance name only; nothing about http
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            self.proc = subprocess.Popen([*REAPER, "-f", str(config)], stdout=out, stderr=err, env=env, cwd=ROOT)

    def events(self, event: str) -> list[dict[str, Any]]:
        found = []
        for line in self.stderr.read_text().splitlines():
            try:
                parsed = json.loads(line)
            except ValueError:
                continue
            if isinstance(parsed, dict) and parsed.get("event") == event:
                found.append(parsed)
        return found

    def output(self) -> str:
        return f"--- {self.name} (exit {self.proc.poll()}):\n{self.stdout.read_text()}{self.stderr.read_text()}"

    @property
    def http_port(self) -> int:
        (started,) = self.events("reaper_started")
        port = started["http_port"]
        assert isinstance(port, int)
        return port

    def get(self, path: str) -> tuple[int, dict[str, Any] | str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.http_port}{path}", timeout=5) as resp:
                status, body = resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            status, body = err.code, err.read().decode()
        except OSError:
            return 0, ""
        return status, (json.loads(body) if path != "/metrics" else body)

    def leads(self) -> bool:
        status, body = self.get("/metrics")
        assert status == 200 and isinstance(body, str), self.output()
        families = text_string_to_metric_families(body)
        return any(s.name == "harvester_is_leader" and s.value == 1.0 for f in families for s in f.samples)

    def readiness(self) -> dict[str, Any] | None:
        status, body = self.get("/readyz")
        return body if status == 200 and isinstance(body, dict) else None

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.mark.integration
def test_three_goharvest_reapers_on_one_host_all_run(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    topics: Callable[..., str],
    tmp_path: Path,
) -> None:
    table = TableName(schema, "outbox")
    topic = topics()
    group = unique("reaper-ports")
    config = tmp_path / "reaper.yaml"
    config.write_text(goharvest_yaml(services, table, group))
    migrated = run_reaper("migrate", "-f", str(config))
    assert migrated.returncode == 0, migrated.stderr
    reapers: list[Process] = []
    try:
        spawned = time.monotonic()
        reapers = [Process(config, f"reaper-{i}", tmp_path) for i in range(3)]

        def all_started() -> bool:
            ended = [r for r in reapers if r.proc.poll() is not None]
            assert not ended, "\n".join(r.output() for r in ended)
            return all(r.events("reaper_started") for r in reapers)

        wait_for("every reaper to log reaper_started", all_started, timeout=90)

        # Each logs the port it actually bound, a different one each; each answers on it.
        ports = [r.http_port for r in reapers]
        assert len(set(ports)) == 3 and all(0 < p < 65536 for p in ports), ports
        for r in reapers:
            assert r.get("/healthz") == (200, {"status": "ok", "threads_alive": True}), r.output()
        # Whoever did not get the default port says so, naming the port it took instead.
        for r in reapers:
            fallbacks = r.events("http_port_in_use")
            if r.http_port == DEFAULT_HTTP_PORT:
                assert not fallbacks
            else:
                assert [(f["level"], f["default_port"], f["http_port"]) for f in fallbacks] == [
                    ("warning", DEFAULT_HTTP_PORT, r.http_port)
                ], r.output()
        assert ports.count(DEFAULT_HTTP_PORT) <= 1

        # Exactly one leads: it delivers a record written to the outbox, and the others stand by.
        wait_for("one leader", lambda: sum(r.leads() for r in reapers) == 1)
        insert(pg, table, topic, 0, 1)
        delivered = read_messages(services.bootstrap, [topic], 1, timeout=60)
        assert {m.value() for m in delivered} == {b"value-0"}
        wait_for("the outbox to drain", lambda: outbox_count(pg, table) == 0)

        def one_ready_leader() -> bool:
            ready = [r.readiness() for r in reapers]
            return all(ready) and [bool(s and s["is_leader"]) for s in ready].count(True) == 1

        wait_for("/readyz to show one leader and two ready standbys", one_ready_leader, timeout=30)
        assert sum(r.leads() for r in reapers) == 1

        # None of them exits on its own.
        time.sleep(max(0.0, STAY_UP - (time.monotonic() - spawned)))
        assert all(r.proc.poll() is None for r in reapers), "\n".join(r.output() for r in reapers)

        for r in reapers:
            r.proc.send_signal(signal.SIGTERM)
        for r in reapers:
            assert r.proc.wait(60) == 0, r.output()
            assert r.events("reaper_stopped"), r.output()
    finally:
        for r in reapers:
            r.kill()
        delete_topics(services.bootstrap, [f"{group}.neli"])


@pytest.mark.integration
@pytest.mark.parametrize("where", ["file", "environment"])
def test_an_explicit_busy_port_is_still_a_one_line_error(services: Services, tmp_path: Path, where: str) -> None:
    # The run fails before it touches the outbox or the leader topic, so neither needs to exist.
    text = goharvest_yaml(services, TableName(unique("absent"), "outbox"), unique("reaper-busy"))
    config = tmp_path / "reaper.yaml"
    with socket.socket() as busy:
        busy.bind(("0.0.0.0", 0))  # the reaper's default host
        busy.listen()
        port = int(busy.getsockname()[1])
        env = reaper_environment()
        if where == "file":
            text += f"http:\n  port: {port}\n"
        else:
            env["REAPER_HTTP__PORT"] = str(port)
        config.write_text(text)
        done = run_reaper("-f", str(config), env=env)
    assert done.returncode == 2, done.stderr
    assert done.stderr == f"reaper: error: http.port: cannot listen on 0.0.0.0:{port}: Address already in use\n"
    assert done.stdout == ""

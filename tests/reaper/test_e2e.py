"""End to end with real processes: migrate, two `reaper run`s draining an outbox written by plain SQL,
SIGTERM handover, a second signal, metrics and logs."""

from __future__ import annotations

import json
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from tests.support.kafka import delete_topics, read_messages
from tests.support.names import unique
from tests.support.services import Services
from tests.support.signals import signal_off_main

pytestmark = pytest.mark.integration

REAPER = str(Path(sys.executable).parent / "reaper")
PG_SECRET = "Pg-E2e-S3cret"
KAFKA_SECRET = "Kafka-E2e-S3cret"
SSL_SECRET = "Ssl-E2e-S3cret"
KEYS = 8
BACKLOG = 4000


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def wait_for(what: str, check: Callable[[], bool], timeout: float = 60.0) -> None:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        if check():
            return
        time.sleep(0.2)
    raise AssertionError(f"timed out waiting for {what}")


class Reaper:
    """One `reaper run` process with its own name, port and captured output."""

    def __init__(self, config: Path, name: str, logs: Path) -> None:
        self.name = name
        self.port = free_port()
        self.stdout = logs / f"{name}.out"
        self.stderr = logs / f"{name}.err"
        env = {
            **{k: v for k, v in os.environ.items() if not k.startswith("REAPER_")},
            "REAPER_HARVEST__NAME": name,
            "REAPER_HTTP__PORT": str(self.port),
            "REAPER_HTTP__HOST": "127.0.0.1",
        }
        with self.stdout.open("w") as out, self.stderr.open("w") as err:
            # goharvest's command line, unchanged: "reaper -f reaper.yaml".
            self.proc = subprocess.Popen([REAPER, "-f", str(config)], stdout=out, stderr=err, env=env)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=5) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except OSError:
            return 0, ""

    def metrics(self) -> dict[str, float]:
        status, body = self.get("/metrics")
        if status != 200:
            return {}
        return {s.name: s.value for f in text_string_to_metric_families(body) for s in f.samples if not s.labels}

    def metric_names(self) -> set[str]:
        return {f.name for f in text_string_to_metric_families(self.get("/metrics")[1])}

    def is_leader(self) -> bool:
        return self.metrics().get("harvester_is_leader") == 1.0

    def ready(self) -> dict[str, object] | None:
        status, body = self.get("/readyz")
        return json.loads(body) if status == 200 else None

    def signal_off_main(self, sig: signal.Signals) -> None:
        signal_off_main(self.proc.pid, sig)

    def signal(self, *sigs: signal.Signals) -> None:
        for sig in sigs:
            self.proc.send_signal(sig)

    def exit_code(self, timeout: float) -> int:
        return self.proc.wait(timeout)

    def output(self) -> str:
        return self.stdout.read_text() + self.stderr.read_text()

    def kill(self) -> None:
        if self.proc.poll() is None:
            self.proc.kill()
            self.proc.wait(10)


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[[Path, str], Reaper]]:
    started: list[Reaper] = []

    def start(config: Path, name: str) -> Reaper:
        reaper = Reaper(config, name, tmp_path)
        started.append(reaper)
        return reaper

    yield start
    for reaper in started:
        reaper.kill()


def insert(pg: psycopg.Connection[tuple[object, ...]], table: TableName, topic: str, start: int, count: int) -> None:
    """Plain SQL INSERTs, as any application would write them (goharvest's documented statement)."""
    statement = sql.SQL(
        "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values)"
        " VALUES (NOW(), %s, %s, %s, %s, %s)"
    ).format(table.ident)
    with pg.transaction(), pg.cursor() as cur:
        rows = [(topic, f"key-{i % KEYS}", f"value-{i}", ["seq"], [str(i)]) for i in range(start, start + count)]
        cur.executemany(statement, rows)


def outbox_count(pg: psycopg.Connection[tuple[object, ...]], table: TableName) -> int:
    row = pg.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone()
    assert row is not None
    return int(str(row[0]))


def goharvest_yaml(services: Services, table: TableName, group: str) -> str:
    dsn = services.pg_dsn.replace("password=local-dev-secret", f"password={PG_SECRET}")
    return f"""\
harvest:
  baseKafkaConfig:
    bootstrap.servers: {services.bootstrap}
    sasl.password: {KAFKA_SECRET}
    ssl.key.password: {SSL_SECRET}
  producerKafkaConfig:
    delivery.timeout.ms: 10000
  leaderTopic: {group}.neli
  leaderGroupID: {group}
  dataSource: {dsn}
  outboxTable: {table.qualified}
  limits:
    minPollInterval: 100ms
    heartbeatTimeout: 5s
    maxInFlightRecords: 1000
    minMetricsInterval: 1s
    sendConcurrency: 4
    sendBuffer: 10
    queueTimeout: 30s
    markBackoff: 10ms
    ioErrorBackoff: 500ms
    markQueryRecords: 100
logging:
  level: Info
"""


def test_reapers_drain_hand_over_and_lose_nothing(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    topics: Callable[..., str],
    tmp_path: Path,
    spawn: Callable[[Path, str], Reaper],
) -> None:
    table = TableName(schema, "outbox")
    topic = topics(partitions=3)
    group = unique("reaper-e2e")
    config = tmp_path / "reaper.yaml"
    config.write_text(goharvest_yaml(services, table, group))
    try:
        migrated = subprocess.run([REAPER, "migrate", "-f", str(config)], capture_output=True, text=True, check=False)
        assert migrated.returncode == 0, migrated.stderr
        assert outbox_count(pg, table) == 0

        a = spawn(config, "reaper-a")
        wait_for("reaper-a to lead", a.is_leader)
        b = spawn(config, "reaper-b")
        wait_for("reaper-b to be a ready standby", lambda: b.ready() is not None)
        assert b.ready() == {
            "status": "ok",
            "is_leader": False,
            "database_ok": True,
            "outbox_ok": True,
            "kafka_ok": True,
            "running": True,
            "state": "running",
        }
        assert a.get("/healthz")[0] == 200 and b.get("/healthz")[0] == 200

        # 1. The leader drains what plain SQL INSERTs wrote.
        insert(pg, table, topic, 0, 200)
        wait_for("the outbox to drain", lambda: outbox_count(pg, table) == 0)
        wait_for("metrics to catch up", lambda: a.metrics().get("harvester_records_purged_total", 0) >= 200)
        m = a.metrics()
        assert m["harvester_records_published_total"] >= 200
        assert m["harvester_publish_latency_seconds_count"] >= 200
        assert m["harvester_mark_query_seconds_count"] > 0
        assert not b.is_leader()
        names = a.metric_names()
        for series in (
            "harvester_records_published",
            "harvester_records_purged",
            "harvester_records_reset",
            "harvester_records_dead_lettered",
            "harvester_in_flight_records",
            "harvester_is_leader",
            "harvester_mark_query_seconds",
            "harvester_publish_latency_seconds",
            "harvester_outbox_backlog_records",
            "harvester_outbox_oldest_record_age_seconds",
        ):
            assert series in names, series

        # 2. SIGTERM in the middle of a backlog: A finishes its in-flight records, leaves the group and
        # exits 0; B takes over at once and publishes the rest. The signal lands on a thread other
        # than A's main one, as the kernel may deliver it: the main thread must still see it.
        insert(pg, table, topic, 200, BACKLOG)
        wait_for("reaper-a to start on the backlog", lambda: a.metrics()["harvester_records_published_total"] > 200)
        a.signal_off_main(signal.SIGTERM)
        assert a.exit_code(30) == 0
        exited = time.monotonic()
        remaining = outbox_count(pg, table)
        assert remaining > 0, "A drained the whole backlog before SIGTERM: raise BACKLOG"
        wait_for("reaper-b to take over", b.is_leader, timeout=30)
        # A left the group: B did not wait for the 10 s session timeout that a vanished member costs.
        assert time.monotonic() - exited < 8
        wait_for("the outbox to drain after the handover", lambda: outbox_count(pg, table) == 0)
        assert b.metrics()["harvester_records_published_total"] >= remaining  # B published what A left

        # 3. A second signal exits at once; unacknowledged records stay in the outbox for the next leader.
        done = 200 + BACKLOG
        insert(pg, table, topic, done, 300)
        b.signal(signal.SIGTERM, signal.SIGINT)
        assert b.exit_code(30) in (128 + signal.SIGINT, 128 + signal.SIGTERM)
        c = spawn(config, "reaper-c")
        # B may have purged everything before its exit, so an empty outbox alone does not show that C
        # is up; signalled before it installs its handlers, C would die of the SIGTERM.
        wait_for("reaper-c to lead", c.is_leader)
        wait_for("the outbox to drain after the immediate exit", lambda: outbox_count(pg, table) == 0)
        c.signal(signal.SIGTERM)
        assert c.exit_code(30) == 0

        # Nothing lost (at least once), and per key the first deliveries keep insertion order.
        total = done + 300
        messages = read_messages(services.bootstrap, [topic], total, timeout=60)
        firsts: dict[int, list[int]] = defaultdict(list)
        seen: set[int] = set()
        for msg in messages:
            header = dict(msg.headers() or [])["seq"]
            assert isinstance(header, bytes)
            seq = int(header)
            assert msg.value() == f"value-{seq}".encode() and msg.key() == f"key-{seq % KEYS}".encode()
            if seq not in seen:
                seen.add(seq)
                firsts[seq % KEYS].append(seq)
        assert seen == set(range(total))
        assert all(seqs == sorted(seqs) for seqs in firsts.values())

        # Logs: JSON lines (not a terminal), each with the instance name; leader lines carry the leader id;
        # no secret anywhere.
        for reaper in (a, b, c):
            text = reaper.output()
            for secret in (PG_SECRET, KAFKA_SECRET, SSL_SECRET):
                assert secret not in text
            raw = reaper.stderr.read_text().splitlines()
            lines = [json.loads(line) for line in raw if not line.startswith("reaper: second signal")]
            assert lines and all(line["instance"] == reaper.name for line in lines)
        assert any("leader_id" in json.loads(line) for line in a.stderr.read_text().splitlines())
    finally:
        delete_topics(services.bootstrap, [f"{group}.neli"])

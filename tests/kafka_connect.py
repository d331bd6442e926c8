"""Kafka Connect standalone with Debezium's PostgreSQL connector (its jars include the outbox
``EventRouter`` transform), for the equivalence test (tests/debezium) and bench/peers.py: the jars,
resolved from Maven Central into the project's cache on first use, and one worker on loopback."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import psycopg
from psycopg import sql

ROOT = Path(__file__).resolve().parent.parent
MAVEN = ROOT / "deploy" / "local" / "maven.py"
CACHE = Path(
    os.environ.get(
        "HARVESTER_CACHE_DIR", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "outbox-harvester"
    )
)
KAFKA_VERSION = "4.1.1"
DEBEZIUM_VERSION = "3.3.2.Final"
CONNECT_LIBS = CACHE / f"connect-{KAFKA_VERSION}" / "libs"
DEBEZIUM_PLUGINS = CACHE / f"debezium-postgres-{DEBEZIUM_VERSION}"  # Connect's plugin.path
STRING_CONVERTER = "org.apache.kafka.connect.storage.StringConverter"
EVENT_ROUTER = "io.debezium.transforms.outbox.EventRouter"
POSTGRES_CONNECTOR = "io.debezium.connector.postgresql.PostgresConnector"


class MissingError(Exception):
    """Something Kafka Connect needs is not available here; the message says what (one line)."""


def _resolve(into: Path, deps: list[tuple[str, str, str]]) -> None:
    """Copy ``deps`` and their runtime dependencies from Maven Central into ``into`` (once; cached),
    with the resolver deploy/local/services.sh uses for Kafka's jars."""
    if (into / ".complete").exists():
        return
    print(f"resolving {', '.join(f'{a} {v}' for _, a, v in deps)} from Maven Central into {into} ...", flush=True)
    done = subprocess.run(
        [sys.executable, str(MAVEN), "--cache", str(CACHE / "maven"), "--into", str(into)]
        + [f"{g}:{a}:{v}" for g, a, v in deps],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    if done.returncode != 0:
        raise MissingError(done.stderr.strip().splitlines()[-1][:300] if done.stderr.strip() else "resolution failed")
    (into / ".complete").touch()


def resolve_jars() -> None:
    _resolve(
        CONNECT_LIBS,
        [
            ("org.apache.kafka", "connect-runtime", KAFKA_VERSION),
            ("org.apache.kafka", "connect-json", KAFKA_VERSION),
            ("org.slf4j", "slf4j-api", "2.0.17"),
            ("org.apache.logging.log4j", "log4j-slf4j2-impl", "2.24.3"),
            ("org.apache.logging.log4j", "log4j-core", "2.24.3"),
        ],
    )
    # A plugin directory of its own, loaded in isolation by Connect (as Debezium's plugin archive is).
    _resolve(
        DEBEZIUM_PLUGINS / "debezium-connector-postgres",
        [("io.debezium", "debezium-connector-postgres", DEBEZIUM_VERSION)],
    )
    if not any((DEBEZIUM_PLUGINS / "debezium-connector-postgres").glob("debezium-core-*.jar")):
        raise MissingError(f"debezium-core (the EventRouter SMT) is not among the resolved jars in {DEBEZIUM_PLUGINS}")


class ConnectWorker:
    """Kafka Connect standalone (one JVM, REST on loopback ``port``) with Debezium's plugin directory,
    producing to ``bootstrap`` with ``compression`` (its producers' compression.type)."""

    def __init__(self, state: Path, port: int, bootstrap: str, compression: str = "none") -> None:
        self.port = port
        self.url = f"http://127.0.0.1:{self.port}"
        self._state = state
        self._bootstrap = bootstrap
        self._compression = compression
        self.log = state / "connect.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._state.mkdir(parents=True, exist_ok=True)
        worker = self._state / "worker.properties"
        worker.write_text(
            f"bootstrap.servers={self._bootstrap}\n"
            f"key.converter={STRING_CONVERTER}\n"
            f"value.converter={STRING_CONVERTER}\n"
            f"offset.storage.file.filename={self._state / 'offsets'}\n"
            "offset.flush.interval.ms=10000\n"
            f"listeners=http://127.0.0.1:{self.port}\n"
            f"rest.advertised.host.name=127.0.0.1\nrest.advertised.port={self.port}\n"
            f"plugin.path={DEBEZIUM_PLUGINS}\n"
            # The plugins' service manifests only: the reflective scan of every jar (Connect's
            # default, beside the manifests) took 79 s of a start on a loaded machine, the manifests 5 s.
            "plugin.discovery=service_load\n"
            f"producer.compression.type={self._compression}\n"
        )
        log4j = self._state / "log4j2.properties"
        log4j.write_text(
            "status = warn\nappender.console.type = Console\nappender.console.name = STDOUT\n"
            "appender.console.layout.type = PatternLayout\nappender.console.layout.pattern = [%d] %p %m (%c)%n\n"
            "rootLogger.level = info\nrootLogger.appenderRef.stdout.ref = STDOUT\n"
            "logger.reflections.name = org.reflections\nlogger.reflections.level = error\n"
        )
        with self.log.open("ab") as out:
            self.proc = subprocess.Popen(
                [
                    "java",
                    "-Xms256m",
                    "-Xmx1g",
                    "-XX:+UseG1GC",
                    f"-Dlog4j2.configurationFile={log4j}",
                    "-cp",
                    f"{CONNECT_LIBS}/*",
                    "org.apache.kafka.connect.cli.ConnectStandalone",
                    str(worker),
                ],
                stdout=out,
                stderr=subprocess.STDOUT,
                stdin=subprocess.DEVNULL,
            )
        deadline = time.monotonic() + 300
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MissingError(f"Kafka Connect exited during start-up: {self.last_error()}")
            try:
                plugins = {p["class"] for p in self.request("GET", "/connector-plugins?connectorsOnly=false")}
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
                continue
            for needed in (POSTGRES_CONNECTOR, EVENT_ROUTER):
                if needed not in plugins:
                    raise MissingError(
                        f"Kafka Connect does not list the plugin {needed} (plugin.path={DEBEZIUM_PLUGINS})"
                    )
            return
        raise MissingError(f"Kafka Connect's REST API did not answer within 300 s: {self.last_error()}")

    def last_error(self) -> str:
        lines = self.log.read_text(errors="replace").splitlines() if self.log.exists() else []
        errors = [line for line in lines if " ERROR " in line or "Exception" in line] or lines or ["(no log)"]
        return f"{errors[-1][:300]} (log: {self.log})"

    def request(self, method: str, path: str, body: Any = None) -> Any:
        data = None if body is None else json.dumps(body).encode()
        req = urllib.request.Request(
            self.url + path,
            data=data,
            method=method,
            headers={"Content-Type": "application/json", "Accept": "application/json"},
        )
        with urllib.request.urlopen(req, timeout=30) as resp:
            text = resp.read()
        return json.loads(text) if text else None

    def assert_running(self, name: str) -> None:
        """Raise :class:`MissingError` when connector ``name``'s task failed."""
        status = self.request("GET", f"/connectors/{name}/status")
        for task in status.get("tasks", []):
            if task.get("state") == "FAILED":
                trace = (task.get("trace") or "").splitlines()
                raise MissingError(f"Debezium's task failed: {trace[0][:300] if trace else task}")

    def wait_streaming(self, conn: psycopg.Connection[Any], name: str, slot: str) -> None:
        """Until connector ``name``'s task runs and its replication slot is in use by a WAL sender."""
        deadline = time.monotonic() + 90
        while time.monotonic() < deadline:
            try:
                self.assert_running(name)
            except urllib.error.HTTPError:  # 404 until the connector is registered
                time.sleep(0.2)
                continue
            row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
            if row is not None and row[0]:
                return
            time.sleep(0.2)
        raise MissingError(f"Debezium's connector did not start streaming within 90 s: {self.last_error()}")

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


def drop_slot(conn: psycopg.Connection[Any], name: str, publication: str | None = None) -> None:
    """Drop slot ``name`` once no WAL sender holds it (a stopped connector's lets go within
    seconds), and the publication (default: the slot's name)."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (name,)).fetchone()
        if row is None:
            break
        if not row[0]:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (name,))
            break
        time.sleep(0.2)
    conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(publication or name)))

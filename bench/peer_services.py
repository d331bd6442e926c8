"""What bench/peers.py runs Debezium in: its jars and Kafka Connect's, resolved from Maven Central
into the project's cache; a private PostgreSQL with ``wal_level=logical``; one Connect standalone
worker on loopback."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Any

import harvest
import psycopg
from cpu import process_seconds

from harvester import Limits

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "deploy" / "local" / "services.sh"
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
BOOTSTRAP = harvest.BOOTSTRAP
PARTITIONS = 4
TUNED = Limits(mark_query_records=500, max_in_flight_records=5000)


class MissingError(Exception):
    """Something the bench needs is not available here; the message says what (one line)."""


# ---------------------------------------------------------------- jars


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


# ---------------------------------------------------------------- private services


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LogicalPostgres:
    """A private PostgreSQL with ``wal_level=logical`` and replication connections from loopback
    (deploy/local/services.sh in a temporary directory, as tests/support.py's PrivatePostgres)."""

    def __init__(self, state: Path) -> None:
        self.port = free_port()
        self.dsn = f"host=127.0.0.1 port={self.port} user=harvester password=local-dev-secret dbname=harvester"
        self._env = {**os.environ, "HARVESTER_LOCAL_DIR": str(state), "PGPORT": str(self.port)}
        self.started = False

    def _run(self, command: str) -> None:
        done = subprocess.run(
            ["bash", str(SERVICES), command], env=self._env, capture_output=True, text=True, timeout=180, check=False
        )
        if done.returncode != 0:
            last = (done.stderr.strip().splitlines() or ["(no output)"])[-1]
            raise MissingError(f"private PostgreSQL: services.sh {command} failed: {last}")

    def start(self) -> None:
        self.started = True
        self._run("start-postgres")  # wal_level=logical, replication from loopback: services.sh's defaults
        with psycopg.connect(self.dsn, autocommit=True) as conn:
            row = conn.execute("SHOW wal_level").fetchone()
        if row is None or row[0] != "logical":
            raise MissingError(f"private PostgreSQL did not take wal_level=logical (it has {row})")

    def stop(self) -> None:
        if self.started:
            self._run("stop-postgres")


class ConnectWorker:
    """Kafka Connect standalone (one JVM, REST on loopback) with Debezium's plugin directory."""

    def __init__(self, state: Path, compression: str) -> None:
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._state = state
        self._compression = compression  # its producers' compression.type
        self.log = state / "connect.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._state.mkdir(parents=True, exist_ok=True)
        worker = self._state / "worker.properties"
        worker.write_text(
            f"bootstrap.servers={BOOTSTRAP}\n"
            "key.converter=org.apache.kafka.connect.storage.StringConverter\n"
            "value.converter=org.apache.kafka.connect.storage.StringConverter\n"
            f"offset.storage.file.filename={self._state / 'offsets'}\n"
            "offset.flush.interval.ms=10000\n"
            f"listeners=http://127.0.0.1:{self.port}\n"
            f"rest.advertised.host.name=127.0.0.1\nrest.advertised.port={self.port}\n"
            f"plugin.path={DEBEZIUM_PLUGINS}\n"
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
        deadline = time.monotonic() + 120
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MissingError(f"Kafka Connect exited during start-up: {self._last_error()}")
            try:
                self.request("GET", "/connector-plugins?connectorsOnly=false")
            except (OSError, urllib.error.URLError):
                time.sleep(0.5)
                continue
            plugins = {p["class"] for p in self.request("GET", "/connector-plugins?connectorsOnly=false")}
            for needed in (
                "io.debezium.connector.postgresql.PostgresConnector",
                "io.debezium.transforms.outbox.EventRouter",
            ):
                if needed not in plugins:
                    raise MissingError(
                        f"Kafka Connect does not list the plugin {needed} (plugin.path={DEBEZIUM_PLUGINS})"
                    )
            return
        raise MissingError(f"Kafka Connect's REST API did not answer within 120 s: {self._last_error()}")

    def _last_error(self) -> str:
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

    def cpu(self) -> float:
        return process_seconds(self.proc.pid) if self.proc else 0.0

    def stop(self) -> None:
        if self.proc is None or self.proc.poll() is not None:
            return
        self.proc.terminate()
        try:
            self.proc.wait(30)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(10)


# ---------------------------------------------------------------- one burst

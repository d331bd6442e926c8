"""The run's private PostgreSQL and Kafka, and its tables: the outbox (a table, or a table-less
outbox's name), the ledger of what was committed and the fence audit."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass

import psycopg
from psycopg import sql

from harvester import HarvesterConfig
from harvester.postgres.log import logical
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import ensure, fence_table, migrate
from tests.chaos import audit
from tests.chaos.settings import ChaosSettings
from tests.engine.workload import wait_drained
from tests.support.names import unique
from tests.support.private_services import PrivateKafka, PrivatePostgres


@contextmanager
def private_services(settings: ChaosSettings) -> Iterator[tuple[PrivatePostgres, PrivateKafka]]:
    """Start a PostgreSQL cluster and a Kafka broker of the chaos run's own; stop them afterwards."""
    # Data under .local/private-chaos, or a directory per port on other ports, so that runs on
    # different ports can run at once.
    default = (settings.pg_port, settings.kafka_port) == (ChaosSettings.pg_port, ChaosSettings.kafka_port)
    name = "chaos" if default else f"chaos-{settings.pg_port}"
    pg = PrivatePostgres(name, settings.pg_port)
    kafka = PrivateKafka(name, settings.kafka_port)
    pg.start()
    try:
        try:
            kafka.start()  # a broker that does not answer in time is left running: stopped below
            yield pg, kafka
        finally:
            kafka.stop()
    finally:
        pg.stop()


@dataclass(frozen=True)
class Tables:
    """The run's outbox (a table, or the name of a table-less outbox), its ledger and the fence
    audit (:mod:`tests.chaos.audit`), all in one fresh schema."""

    outbox: TableName
    ledger: TableName  # (key, seq, at) of every committed record: the expected contents of the topics
    audit: TableName  # terms and every change of the outbox, fence and dead-letter rows: who, when
    positioned: bool = False  # whether the log source stores how far it is done (see positioned())

    @classmethod
    def create(cls, dsn: str, settings: ChaosSettings | None = None) -> Tables:
        """Create the schema, migrate the outbox (with the log source's publication and slot when
        the source is log; fence and dead-letter tables only for a table-less outbox) and add the
        ledger and the audit."""
        settings = settings or ChaosSettings(seed=0)
        schema = unique("chaos")
        outbox = TableName(schema, "outbox")
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            if settings.layout == "debezium":  # the application's table, as Debezium's outbox users have it
                conn.execute(sql.SQL(DEBEZIUM_DDL).format(outbox.ident))
            if settings.log_messages or settings.layout == "debezium":
                ensure(conn, outbox, "fence")
                ensure(conn, outbox, "dead_letter", value_type="BYTEA")
            else:
                migrate(conn, outbox)
            if settings.source == "log":
                logical.create(conn, log_setup(outbox, settings))
            ledger = TableName(schema, "ledger")
            conn.execute(
                sql.SQL(
                    "CREATE TABLE {} (key TEXT NOT NULL, seq INT NOT NULL, "
                    "at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), PRIMARY KEY (key, seq))"
                ).format(ledger.ident)
            )
        # A Debezium outbox's rows are deleted by the writers, never by a harvester (no retention).
        rows = not settings.log_messages and settings.layout != "debezium"
        trail = audit.install(dsn, outbox, shards=settings.shards, outbox=rows)
        return cls(outbox, ledger, trail, positioned(settings))

    @property
    def schema(self) -> str:
        """The run's schema, that of all three tables."""
        assert self.outbox.schema is not None  # create() qualifies every table
        return self.outbox.schema

    def drop(self, dsn: str) -> None:
        """Drop the run's schema, and its publication and slot if it had them: a slot outlives its
        table and holds one of the cluster's few (``max_replication_slots``) for good."""
        config = HarvesterConfig(outbox_table=self.outbox.qualified)
        with psycopg.connect(dsn, autocommit=True) as conn:
            conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(self.schema)))
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(config.publication)))
            conn.execute(
                "SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s",
                (config.slot,),
            )

    def expected(self, dsn: str) -> dict[str, int]:
        """Committed records per key, from the ledger."""
        with psycopg.connect(dsn) as conn:
            rows = conn.execute(sql.SQL("SELECT key, count(*) FROM {} GROUP BY key").format(self.ledger.ident))
            return {str(k): int(n) for k, n in rows}

    def undelivered(self, dsn: str) -> set[str]:
        """Values still in the outbox (not purged yet: late, not lost); none where rows stay after
        delivery (a retention window) or there are none (a table-less outbox)."""
        if self.positioned:
            return set()
        with psycopg.connect(dsn) as conn:
            return {str(v) for (v,) in conn.execute(sql.SQL("SELECT kafka_value FROM {}").format(self.outbox.ident))}

    def drain(self, dsn: str, timeout: float, end: int) -> int:
        """Wait up to ``timeout`` until the outbox is drained: empty, or where the log source
        stores how far it is done, that position at ``end`` (the log's end once the writers
        stopped). What is left: records, or bytes of log."""
        if not self.positioned:
            return wait_drained(dsn, self.outbox, timeout)
        deadline = time.monotonic() + timeout
        query = sql.SQL("SELECT coalesce(max(log_lsn), 0) FROM {} WHERE outbox_table = %s").format(
            fence_table(self.outbox).ident
        )
        with psycopg.connect(dsn, autocommit=True) as conn:
            while True:
                row = conn.execute(query, (self.outbox.qualified,)).fetchone()
                left = max(0, end - int(row[0] if row else 0))
                if left == 0 or time.monotonic() > deadline:
                    return left
                time.sleep(0.1)


# Debezium's outbox layout with EventRouter's default column names (tests/chaos/writers.py writes it).
DEBEZIUM_DDL = """CREATE TABLE {} (id UUID PRIMARY KEY DEFAULT gen_random_uuid(), aggregatetype TEXT NOT NULL,
  aggregateid TEXT NOT NULL, type TEXT NOT NULL, payload TEXT)"""


def log_setup(outbox: TableName, settings: ChaosSettings) -> logical.LogSetup:
    """The log source's slot, publication and (table-less) message prefix for the run's outbox."""
    config = HarvesterConfig(
        outbox_table=outbox.qualified, source="log", log_messages=settings.log_messages, layout=settings.layout
    )
    return config.log_setup


def positioned(settings: ChaosSettings) -> bool:
    """Whether the log source stores how far it is done in the fence row instead of deleting rows
    as it goes: a table-less outbox, a table with a retention window, Debezium's layout."""
    return settings.log_messages or settings.log_retention > 0 or settings.layout == "debezium"


def wal_end(dsn: str) -> int:
    """The end of the log now."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute("SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), '0/0')::bigint").fetchone()
    assert row is not None
    return int(row[0])

"""A paused leader (SIGSTOP past the session timeout) wakes up as a zombie: it changes no outbox row
after a standby took over, and per-key order of first deliveries holds."""

from __future__ import annotations

import os
import signal
import time
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check, wait_drained, writing
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support import Services, read_messages, unique

pytestmark = [pytest.mark.integration, pytest.mark.slow]


def install_audit(dsn: str, table: TableName) -> TableName:
    """Record which connection (application_name) updated or deleted which outbox row, and when."""
    audit = TableName(table.schema, "audit")
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {a} (app TEXT, op TEXT, id BIGINT, at TIMESTAMPTZ DEFAULT clock_timestamp());"
                "CREATE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN "
                "INSERT INTO {a} (app, op, id) VALUES (current_setting('application_name'), TG_OP, OLD.id); "
                "RETURN NULL; END $$;"
                "CREATE TRIGGER audit AFTER UPDATE OR DELETE ON {t} FOR EACH ROW EXECUTE FUNCTION {f}();"
            ).format(a=audit.ident, f=TableName(table.schema, "audit_fn").ident, t=table.ident)
        )
    return audit


def test_sigstopped_leader_changes_nothing_after_takeover(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    topic = topics(partitions=3)
    audit = install_audit(services.pg_dsn, outbox)
    group = unique("zombie")

    def spec(name: str) -> dict[str, object]:
        return harvester_spec(
            services.pg_dsn,
            services.bootstrap,
            outbox,
            group,
            name,
            limits={"mark_query_records": 10, "max_in_flight_records": 50},
        )

    a = HarvesterProcess(spec("zombie-a"))
    b: HarvesterProcess | None = None
    try:
        assert a.wait_for("LeaderAcquired"), a.log
        b = HarvesterProcess(spec("standby-b"))
        assert b.wait_for("started")
        writer = writing(services.pg_dsn, outbox, topic, keys=30, per_key=60, writers=3, per_txn=1)
        time.sleep(1.5)
        os.kill(a.proc.pid, signal.SIGSTOP)
        assert b.wait_for("LeaderAcquired", timeout=30), b.log
        time.sleep(2.0)  # the new leader publishes and purges meanwhile
        with psycopg.connect(services.pg_dsn) as conn:
            row = conn.execute(
                sql.SQL("SELECT acquired_at FROM {} WHERE outbox_table = %s").format(
                    TableName(outbox.schema, "harvester_fence").ident
                ),
                (outbox.qualified,),
            ).fetchone()
        assert row is not None
        takeover = row[0]
        resumed = time.time()
        os.kill(a.proc.pid, signal.SIGCONT)
        writer.join()
        assert wait_drained(services.pg_dsn, outbox, timeout=90) == 0
        # The zombie reports that it no longer leads, whichever noticed first (elector or fence).
        assert a.wait_for("LeaderFenced", timeout=15, after=resumed) or a.seen("LeaderRevoked", after=resumed)
        with psycopg.connect(services.pg_dsn) as conn:
            late = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE app LIKE %s AND at > %s").format(audit.ident),
                ("%zombie-a%", takeover),
            ).fetchone()
            early = conn.execute(
                sql.SQL("SELECT count(*) FROM {} WHERE app LIKE %s").format(audit.ident), ("%zombie-a%",)
            ).fetchone()
        assert early is not None and early[0] > 0  # the zombie did work before the pause ...
        assert late == (0,)  # ... and changed no row after the takeover
    finally:
        a.terminate()
        if b is not None:
            b.terminate()
    verdict = check(read_messages(services.bootstrap, [topic], 1800), {f"k{i}": 60 for i in range(30)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0

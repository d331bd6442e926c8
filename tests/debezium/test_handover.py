"""Two harvesters on Debezium's outbox layout: the leader is killed (SIGKILL) while the application
goes on writing, each row deleted in the transaction that inserted it (the framework extensions'
pattern, so the records exist only in the log), and the other takes over from the position the fence
row stores done: nothing is lost, each key keeps its order, and what at-least-once publishes twice
is dropped by ``DedupReader``'s rule. ``reaper status`` then reports a leader, and the slot as the
backlog."""

from __future__ import annotations

import json
import threading
from pathlib import Path

import psycopg
import pytest
from confluent_kafka import Message
from psycopg import sql

from harvester import HarvesterConfig
from harvester.client.dedup import DedupState
from harvester.core.identity import Identity
from harvester.postgres.log import logical
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import ensure
from tests.engine.workload import check, wait_until
from tests.log.conftest import drop_slot, logical_dsn, stored_done  # noqa: F401 (logical_dsn: the fixture)
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.kafka import consumed_headers, create_topics, delete_topics, read_messages
from tests.support.names import unique
from tests.support.reaper import run_reaper
from tests.support.services import Services

pytestmark = pytest.mark.integration

KEYS, TRANSACTIONS = 10, 100  # a row of each key per transaction: 1,000 records in about 3 s


def write(dsn: str, table: TableName, started: threading.Event) -> None:
    """Insert-then-delete transactions, a row per key each, values ``<key>:<seq>``; ``started`` is set
    after the first third, so that the leader is killed while the rest are written."""
    columns = "id, aggregatetype, aggregateid, type, payload"
    insert = sql.SQL("INSERT INTO {} (" + columns + ") VALUES (gen_random_uuid(), 'Order', %s, 'T', %s)").format(
        table.ident
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        for seq in range(TRANSACTIONS):
            with conn.transaction(), conn.cursor() as cur:
                cur.executemany(insert, [(f"k{k}", f"k{k}:{seq}") for k in range(KEYS)])
                cur.execute(sql.SQL("DELETE FROM {}").format(table.ident))
            if seq == TRANSACTIONS // 3:
                started.set()
            threading.Event().wait(0.02)  # an application's pace, not a burst


def past_dedup(messages: list[Message]) -> list[Message]:
    """The records a ``DedupReader`` passes, reading ``messages`` in their order."""
    state = DedupState()
    out = []
    for m in messages:
        identity = Identity.from_headers(consumed_headers(m))
        assert identity is not None
        if not state.observe((identity.producer, m.topic() or "", m.key()), identity):  # True: a repeat
            out.append(m)
    return out


def test_the_other_harvester_takes_over_with_nothing_lost(
    services: Services,
    logical_dsn: str,  # noqa: F811 (the fixture)
    tmp_path: Path,
) -> None:
    schema = unique("dbzho")
    table = TableName(schema, "outboxevent")
    group = unique("dbzho")

    def spec(name: str) -> dict[str, object]:
        return harvester_spec(
            logical_dsn, services.bootstrap, table, group, name,
            source="log", layout="debezium", event_router={"route.topic.replacement": schema},
            limits={"io_error_backoff": "100ms"},
        )  # fmt: skip

    settings = {k: v for k, v in spec("setup").items() if k != "session_timeout"}  # the process's, not a field
    setup = HarvesterConfig.model_validate(settings).log_setup
    (tmp_path / "reaper.yaml").write_text(json.dumps({"harvest": settings}))  # YAML reads JSON
    create_topics(services.bootstrap, [schema], 3)
    a = b = None
    with psycopg.connect(logical_dsn, autocommit=True) as conn:
        try:
            conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
            columns = "id UUID PRIMARY KEY, aggregatetype TEXT, aggregateid TEXT, type TEXT, payload TEXT"
            conn.execute(sql.SQL("CREATE TABLE {} (" + columns + ")").format(table.ident))
            ensure(conn, table, "fence")
            ensure(conn, table, "dead_letter", value_type="BYTEA")
            logical.create(conn, setup)
            a = HarvesterProcess(spec("a"))
            assert a.wait_for("LeaderAcquired"), a.log
            b = HarvesterProcess(spec("b"))
            assert b.wait_for("started"), b.log
            started = threading.Event()
            writer = threading.Thread(target=write, args=(logical_dsn, table, started))
            writer.start()
            assert started.wait(60)
            assert wait_until(lambda: stored_done(logical_dsn, table) > 0, timeout=60)  # a published some
            a.proc.kill()
            assert b.wait_for("LeaderAcquired", timeout=30), b.log
            writer.join()
            messages = read_messages(services.bootstrap, [schema], KEYS * TRANSACTIONS, timeout=90)
            # reaper status: a leader; the backlog is the slot's, the table's rows do not tell it.
            status = run_reaper("status", "--json", "-f", str(tmp_path / "reaper.yaml"))
            assert status.returncode == 0, status.stderr
            report = json.loads(status.stdout)
            assert report["leader"] is not None and report["backlog_records"] == 0 and report["slot"] is not None
        finally:
            for p in (a, b):
                if p is not None:
                    p.terminate()
            drop_slot(conn, setup.slot)
            conn.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(setup.publication)))
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
            delete_topics(services.bootstrap, [schema])
    epochs = {identity.epoch for m in messages if (identity := Identity.from_headers(consumed_headers(m)))}
    assert len(epochs) == 2  # both leaders published: a's term, then b's
    verdict = check(past_dedup(messages), {f"k{k}": TRANSACTIONS for k in range(KEYS)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    assert verdict.duplicates == 0  # none past the de-duplicating reader

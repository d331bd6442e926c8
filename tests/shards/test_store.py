"""Sharded stores over one outbox: the shard of a key, the fence per (outbox, shard) with its
recorded number of shards, and a mark query that reads only its own shard's index entries."""

from __future__ import annotations

import subprocess
import sys
import threading
import uuid
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harvester import PostgresStore
from harvester.core.protocols import FencedError, ShardCountError
from harvester.core.shards import shard_of
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import Migration, available, ensure, ensure_shard_index, fence_table, render
from harvester.postgres.schema.sharding import shard_expression, shard_index
from harvester.postgres.table.marks import FIRST_ID
from harvester.postgres.table.statements import id_array
from tests.engine.workload import insert
from tests.support.paths import ROOT
from tests.support.postgres import create_goharvest_outbox
from tests.support.services import Services

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[tuple[object, ...]]


def test_python_and_sql_agree_on_every_key_shard(pg: Conn) -> None:
    keys = ["", "a", "k1", "order-42", "Ünïcødé ключ 鍵", "x" * 100, *(f"key{i}" for i in range(300))]
    for shards in (1, 2, 3, 4, 16):
        rows = pg.execute(
            sql.SQL("SELECT kafka_key, {} FROM unnest(%s::text[]) AS k(kafka_key)").format(shard_expression(shards)),
            (keys,),
        ).fetchall()
        assert {str(k): int(str(s)) for k, s in rows} == {k: shard_of(k, shards) for k in keys}
    spread = {shard_of(f"key{i}", 4) for i in range(300)}
    assert spread == {0, 1, 2, 3}


def test_a_fence_row_from_before_shards_keeps_its_epoch(services: Services, pg: Conn, schema: str) -> None:
    """A goharvest table whose fence was taken by an earlier version (one row per outbox, keyed by
    the table alone): after the fence migration the row is shard 0 of 1 and the next term goes on
    from its epoch."""
    table = TableName(schema, "outbox")
    create_goharvest_outbox(pg, table)
    old: list[Migration] = [m for m in available() if m.version in ("0003_fence", "0007_checkpoint")]
    for m in old:
        pg.execute(render(m, table, pg).encode())
    pg.execute(
        sql.SQL("INSERT INTO {} (outbox_table, epoch, checkpoint_position) VALUES (%s, 7, 3)").format(
            fence_table(table).ident
        ),
        (table.qualified,),
    )
    assert "0009_fence_shards" in ensure(pg, table, "fence")
    insert(services.pg_dsn, table, [("t", "k", "v")])
    store = PostgresStore.open(services.pg_dsn, table)
    try:
        assert store.acquire(uuid.uuid4()) == 8
        assert store.checkpoint_position() == 3
        assert [r.key for r in store.mark(uuid.uuid4(), 10)] == ["k"]
    finally:
        store.close()
    row = pg.execute(sql.SQL("SELECT shard, shards, epoch FROM {}").format(fence_table(table).ident)).fetchall()
    assert row == [(0, 1, 8)]


def test_each_shard_marks_its_own_keys_under_its_own_fence(services: Services, outbox: TableName) -> None:
    keys = [f"k{i}" for i in range(40)]
    insert(services.pg_dsn, outbox, [("t", k, f"v{n}") for n in range(3) for k in keys])
    first = PostgresStore.open(services.pg_dsn, outbox, shards=4)
    stores = [first, *(first.sibling(i) for i in range(1, 4))]
    try:
        # Every term's epoch is above every other shard's: readers tell the shards' terms apart.
        assert [s.acquire(uuid.uuid4()) for s in stores] == [1, 2, 3, 4]
        marked = {s.shard: s.mark(uuid.uuid4(), 1000) for s in stores}
        for shard, records in marked.items():
            assert records and {shard_of(r.key, 4) for r in records} == {shard}
            assert [r.id for r in records] == sorted(r.id for r in records)
        assert sum(len(r) for r in marked.values()) == len(keys) * 3
        # A new term of shard 1 fences shard 1's previous term only.
        stale_epoch = stores[1].epoch
        newer = first.sibling(1)
        assert newer.acquire(uuid.uuid4()) == 5
        with pytest.raises(FencedError):
            stores[1].purge([r.id for r in marked[1]])
        stores[2].purge([r.id for r in marked[2]])
        assert stale_epoch == 2
        newer.close()
    finally:
        for s in stores:
            s.close()


def test_another_number_of_shards_is_refused(services: Services, outbox: TableName) -> None:
    one = PostgresStore.open(services.pg_dsn, outbox)  # prepared while no shard was recorded
    four = PostgresStore.open(services.pg_dsn, outbox, shards=4)
    try:
        four.acquire(uuid.uuid4())
        two = PostgresStore(services.pg_dsn, outbox, shards=2)
        with pytest.raises(ShardCountError) as refused:
            two.prepare()
        two.close()
        message = str(refused.value)
        assert "harvest.shards is 2" in message and "with 4 shards" in message and "\n" not in message
        # A reaper that prepared before the number was recorded is refused at its next term.
        with pytest.raises(ShardCountError):
            one.acquire(uuid.uuid4())
    finally:
        one.close()
        four.close()


def _nodes(plan: dict[str, Any]) -> list[dict[str, Any]]:
    return [plan, *(n for child in plan.get("Plans", []) for n in _nodes(child))]


@pytest.mark.parametrize("statistics", ["stale", "fresh"])
def test_the_mark_query_reads_only_its_shards_index_entries(
    services: Services, pg: Conn, outbox: TableName, statistics: str
) -> None:
    """Whatever the statistics say: "stale" ones were taken while the outbox was empty (a burst
    just landed), "fresh" ones know that half the rows (2 shards) are the shard's, which makes a
    walk of the primary key filtering the other shard's rows look cheap."""
    shards, rows = 2, 20_000
    pg.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(outbox.ident))
    store = PostgresStore.open(services.pg_dsn, outbox, shards=shards)  # builds the index
    pg.execute(sql.SQL("ANALYZE {}").format(outbox.ident))
    copy = sql.SQL("COPY {} (kafka_topic, kafka_key, kafka_value) FROM STDIN").format(outbox.ident)
    with pg.cursor().copy(copy) as cp:
        for i in range(rows):
            cp.write_row(("t", f"k{i % 997}", "v"))
    if statistics == "fresh":
        pg.execute(sql.SQL("ANALYZE {}").format(outbox.ident))
    try:
        epoch = store.acquire(uuid.uuid4())
        shard, limit = 1, 100
        conn = store.db.conn()  # the store's own connection, with its planner settings
        explain = sql.SQL("EXPLAIN (ANALYZE, FORMAT JSON) ") + store._ready().statements.mark
        # The shard's first ids are handed out: the walk passes over them, each looked up in the
        # skipped ids once they are a constant of the plan (hashed), not an InitPlan's result.
        first = sql.SQL("SELECT id FROM {} WHERE {} = %s ORDER BY id LIMIT 10")
        skip = [int(str(r[0])) for r in pg.execute(first.format(outbox.ident, shard_expression(shards)), (shard,))]
        params = (outbox.qualified, 0, epoch, shard, shard + 1, FIRST_ID, id_array(skip), limit)
        found = conn.execute(explain, params).fetchone()
        assert found is not None
        plan: dict[str, Any] = found[0][0]["Plan"]
        scans = [n for n in _nodes(plan) if n.get("Relation Name") == outbox.name]
        # The shard's rows are found through its index, and then read by their ids: no scan of the
        # table without an index condition.
        assert all("Index Cond" in n or "Recheck Cond" in n for n in scans), scans
        picking = [n for n in scans if n.get("Index Name") == shard_index(outbox, shards).name]
        assert len(picking) == 1, scans
        # An ordered walk of the shard's own entries: none filtered out but the skipped ones, no
        # sort, as many as marked; the skip a constant array (no parameter, no sub-plan).
        assert picking[0]["Node Type"] == "Index Scan" and "Index Cond" in picking[0], picking
        assert picking[0].get("Rows Removed by Filter", 0) == len(skip) == 10
        assert int(picking[0]["Actual Rows"]) == limit
        assert "'{" in picking[0]["Filter"] and "$" not in picking[0]["Filter"], picking[0]["Filter"]
        assert conn.execute("SHOW plan_cache_mode").fetchone() == ("force_custom_plan",)
        assert not [n for n in _nodes(plan) if n["Node Type"] == "Sort"]
    finally:
        store.close()


def test_reaper_migrate_builds_the_index_of_the_configured_shards(
    services: Services, pg: Conn, outbox: TableName, tmp_path: Path
) -> None:
    path = tmp_path / "reaper.yaml"
    path.write_text(
        f"harvest:\n  dataSource: {services.pg_dsn}\n  outboxTable: {outbox.qualified}\n  shards: 4\n", "utf-8"
    )
    first = subprocess.run(
        [sys.executable, "-m", "harvester.daemon.cli", "migrate", "-f", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert first.returncode == 0, first.stderr
    index = shard_index(outbox, 4)
    assert f"created index {index.name} for 4 shards" in first.stdout
    found = pg.execute("SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", (index.quoted,))
    assert found.fetchall() == [(True,)]
    again = subprocess.run(
        [sys.executable, "-m", "harvester.daemon.cli", "migrate", "-f", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        check=False,
    )
    assert (again.returncode, again.stdout) == (0, f"outbox table {outbox}: up to date\n")


def test_reapers_starting_together_build_the_shard_index_once_without_deadlock(
    services: Services, outbox: TableName
) -> None:
    """Several reapers prepare a sharded outbox at once: one builds the index CONCURRENTLY while the
    others wait for it; a waiter must not hold a snapshot the build waits out (a deadlock, 40P01)."""
    insert(services.pg_dsn, outbox, [("t", f"k{i}", "v" * 100) for i in range(20000)])
    barrier = threading.Barrier(3)
    built: list[bool] = []
    errors: list[BaseException] = []

    def build() -> None:
        try:
            with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
                barrier.wait(10)
                built.append(ensure_shard_index(conn, outbox, 4))
        except BaseException as exc:
            errors.append(exc)

    threads = [threading.Thread(target=build) for _ in range(3)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(120)
    assert errors == []
    assert sorted(built) == [False, False, True]
    with psycopg.connect(services.pg_dsn) as conn:
        row = conn.execute(
            "SELECT indisvalid FROM pg_index WHERE indexrelid = to_regclass(%s)", (shard_index(outbox, 4).quoted,)
        ).fetchone()
    assert row == (True,)

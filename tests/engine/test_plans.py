"""The store's prepared statements fit the table as it is now: a burst into an outbox that was empty
while the harvester idled is marked and purged through the primary key's index from the first mark,
not by whole-table scans until autoanalyze happens to run."""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable

import psycopg
import pytest
from psycopg import sql

from harvester import Harvester, PostgresStore
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.table.statements import dense_range, whole_range
from tests.engine.workload import insert, wait_until
from tests.support.harvesters import HarvesterFactory
from tests.support.services import Services

pytestmark = pytest.mark.integration

BURST = 20_000


def scans(conn: psycopg.Connection[tuple[object, ...]], table: TableName) -> tuple[int, int]:
    """(sequential scans, index scans) of ``table`` so far, as the statistics system counts them."""
    row = conn.execute(
        "SELECT seq_scan, coalesce(idx_scan, 0) FROM pg_stat_user_tables WHERE relid = to_regclass(%s)",
        (table.quoted,),
    ).fetchone()
    assert row is not None
    return int(str(row[0])), int(str(row[1]))


def marks(h: Harvester) -> float:
    """Mark queries run so far."""
    for metric in h.metrics.registry.collect():
        if metric.name == "harvester_mark_query_seconds":
            return float(next(s.value for s in metric.samples if s.name.endswith("_count")))
    return 0.0


def test_a_burst_into_an_idle_outbox_is_drained_by_index_scans(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    outbox: TableName,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
) -> None:
    topic = topics()
    # No autoanalyze: the statistics stay those of an empty table, as in the seconds after a burst.
    pg.execute(sql.SQL("ALTER TABLE {} SET (autovacuum_enabled = false)").format(outbox.ident))
    # Idle marks back off from 5 ms to 2 s: soon more than the 5 PostgreSQL needs before it may switch
    # a prepared statement to a generic plan, then rare enough not to blur the scan counts.
    h = make_harvester(mark_backoff="5ms", max_mark_backoff="2s", settings={"listen_notify": False})
    assert wait_until(lambda: marks(h) >= 8)
    time.sleep(2.5)  # let the backends flush their statistics
    seq_before, idx_before = scans(pg, outbox)
    copy = sql.SQL("COPY {} (kafka_topic, kafka_key, kafka_value) FROM STDIN").format(outbox.ident)
    with pg.cursor().copy(copy) as cp:
        for i in range(BURST):
            cp.write_row((topic, f"k{i % 500}", "x" * 100))
    assert wait_until(lambda: h.metrics.purged._value.get() >= BURST, timeout=120)
    # Every mark and purge of the burst counts an index scan, once the statistics are flushed.
    assert wait_until(lambda: scans(pg, outbox)[1] - idx_before >= BURST // 100, timeout=15)
    seq_after, _ = scans(pg, outbox)
    assert seq_after - seq_before <= 5, "marks or purges scanned the whole table"


def test_a_purge_deletes_exactly_its_ids_close_together_or_far_apart(services: Services, outbox: TableName) -> None:
    # Ids close together are deleted by one walk of their range (purge_range), which passes the
    # rows between them that are still in flight: those must stay. Every id of a range is the range
    # alone (purge_run); an id given twice must not make a range of ids with one missing look whole.
    insert(services.pg_dsn, outbox, [("t", f"k{i}", "v") for i in range(40)])
    store = PostgresStore.open(services.pg_dsn, outbox)
    try:
        store.acquire(uuid.uuid4())
        ids = [r.id for r in store.mark(uuid.uuid4(), 40)]
        close = ids[2:12:2]  # every other id: the range holds as many rows not purged
        far = [ids[0], ids[-1]]
        run = ids[20:30][::-1]  # every id of the range, in any order
        twice = [ids[31], ids[31], ids[33]]  # as many ids as the range ids[31]..ids[33] has, not its middle one
        assert dense_range(close) is not None and dense_range(far) is None
        assert whole_range(run, ids[20], ids[29]) and not whole_range(twice, ids[31], ids[33])
        for purged in (close, far, run, twice):
            store.purge(purged)
        with psycopg.connect(services.pg_dsn) as conn:
            left = [r[0] for r in conn.execute(sql.SQL("SELECT id FROM {} ORDER BY id").format(outbox.ident))]
        assert left == [i for i in ids if i not in {*close, *far, *run, *twice}]
    finally:
        store.close()

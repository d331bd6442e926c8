"""The sink on goharvest's own outbox table, whose create_time and header columns have no default."""

from __future__ import annotations

import json
import os
import time
from datetime import datetime
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql
from pyspark.sql import SparkSession

from harvester.postgres.schema.identifiers import TableName
from tests.spark.jobs import run_stream
from tests.spark.test_batch import leftovers
from tests.support.names import unique
from tests.support.postgres import create_goharvest_outbox
from tests.support.services import Services

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[tuple[object, ...]]


@pytest.fixture
def goharvest(pg: Conn, schema: str) -> TableName:
    """goharvest's outbox table in this test's schema, never migrated."""
    table = TableName(schema, "outbox")
    create_goharvest_outbox(pg, table)
    return table


def server_now(pg: Conn) -> datetime:
    row = pg.execute("SELECT now()").fetchone()
    assert row is not None and isinstance(row[0], datetime)
    return row[0]


def stamped(pg: Conn, table: TableName) -> list[tuple[Any, ...]]:
    """(value, create_time, header keys, header values) of every record, in id order."""
    return pg.execute(
        sql.SQL("SELECT kafka_value, create_time, kafka_header_keys, kafka_header_values FROM {} ORDER BY id").format(
            table.ident
        )
    ).fetchall()


def defaults(pg: Conn, table: TableName) -> list[Any]:
    """The columns of ``table`` that have a default (the sink must not have added any)."""
    return [
        r[0]
        for r in pg.execute(
            "SELECT attname FROM pg_attribute WHERE attrelid = to_regclass(%s) AND attnum > 0 AND atthasdef"
            " ORDER BY attnum",
            (table.quoted,),
        )
    ]


def test_batch_write_stamps_every_row_with_its_commit_time(
    spark: SparkSession, services: Services, pg: Conn, goharvest: TableName, schema: str
) -> None:
    # commitSql runs in the commit transaction: it records that transaction's now() and what the
    # outbox_batch view shows as create_time.
    commits = sql.Identifier(schema, "commits")
    pg.execute(sql.SQL("CREATE TABLE {} (n SERIAL, at TIMESTAMPTZ, shown TIMESTAMPTZ[])").format(commits))
    record = (
        sql.SQL("INSERT INTO {} (at, shown) SELECT now(), array_agg(DISTINCT create_time) FROM outbox_batch")
        .format(commits)
        .as_string(pg)
    )
    options = {"dsn": services.pg_dsn, "table": goharvest.qualified, "topic": "orders", "commitSql": record}
    before = server_now(pg)
    for first in (0, 300):
        df = spark.range(first, first + 300, 1, 3).selectExpr(
            "cast(id % 7 as string) AS key", "cast(id as string) AS value"
        )
        df.write.format("outbox").mode("append").options(**options).save()
    after = server_now(pg)

    got = stamped(pg, goharvest)
    assert [int(v) for v, *_ in got] == list(range(600))  # every row, in DataFrame order
    assert all(keys == [] and values == [] for _, _, keys, values in got)
    committed: list[tuple[Any, ...]] = pg.execute(
        sql.SQL("SELECT at, shown FROM {} ORDER BY n").format(commits)
    ).fetchall()
    assert len(committed) == 2
    # One create_time per write: its commit transaction's now(), also what commitSql sees.
    for (at, shown), rows in zip(committed, (got[:300], got[300:]), strict=True):
        assert {created for _, created, _, _ in rows} == {at}
        assert shown == [at]
    first, second = (at for at, _ in committed)
    assert before <= first < second <= after
    assert defaults(pg, goharvest) == ["id"]
    assert leftovers(pg, goharvest) == (0, 0)


def test_streaming_micro_batches_are_stamped_with_their_commit_time(
    spark: SparkSession, services: Services, pg: Conn, goharvest: TableName, tmp_path: Path
) -> None:
    source = tmp_path / "in"
    source.mkdir()
    for f in range(2):  # one file per micro-batch, taken oldest first
        lines = (json.dumps({"id": n, "key": f"k{n % 3}"}) for n in range(f * 20, (f + 1) * 20))
        path = source / f"part-{f}.json"
        path.write_text("\n".join(lines) + "\n")
        os.utime(path, (time.time() - 60 + f, time.time() - 60 + f))
    before = server_now(pg)
    run_stream(
        spark,
        source,
        tmp_path / "checkpoint",
        "outbox",
        dsn=services.pg_dsn,
        table=goharvest.qualified,
        topic="counts",
        sinkId=unique("sink"),
    )
    after = server_now(pg)

    got = stamped(pg, goharvest)
    assert [int(v) for v, *_ in got] == list(range(40))
    assert all(keys == [] and values == [] for _, _, keys, values in got)
    batches = [{created for _, created, _, _ in rows} for rows in (got[:20], got[20:])]
    assert all(len(times) == 1 for times in batches)
    assert before <= min(batches[0]) < min(batches[1]) <= after
    assert leftovers(pg, goharvest) == (0, 0)

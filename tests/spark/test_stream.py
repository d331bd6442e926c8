"""Streaming writes: a micro-batch is in the outbox exactly once, whatever the restarts."""

from __future__ import annotations

import json
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from pyspark.sql import SparkSession

from harvester.postgres.schema.identifiers import TableName
from harvester.spark.store import SinkTables
from tests.spark.jobs import run_stream
from tests.spark.test_batch import leftovers, records
from tests.support.names import unique

pytestmark = pytest.mark.integration

FILES, PER_FILE = 5, 40


def write_inputs(source: Path, files: int = FILES) -> None:
    """``files`` files of PER_FILE rows each (ids 0, 1, … across them), one micro-batch each."""
    source.mkdir()
    for f in range(files):
        lines = (json.dumps({"id": n, "key": f"k{n % 3}"}) for n in range(f * PER_FILE, (f + 1) * PER_FILE))
        (source / f"part-{f}.json").write_text("\n".join(lines) + "\n")


def test_restarts_around_the_commit_write_every_row_exactly_once(
    spark: SparkSession,
    sink: dict[str, str],
    pg: psycopg.Connection[tuple[object, ...]],
    outbox: TableName,
    tmp_path: Path,
) -> None:
    source, checkpoint, faults = tmp_path / "in", tmp_path / "checkpoint", tmp_path / "faults"
    write_inputs(source)
    faults.mkdir()
    options = {**sink, "topic": "counts", "sinkId": unique("sink"), "faultDir": str(faults)}

    # Batch 1's commit dies before reaching the database (as if the driver crashed after the
    # tasks staged their rows): the restart must write batch 1.
    with pytest.raises(Exception, match="injected fault commitBefore b1"):
        run_stream(spark, source, checkpoint, "outbox_faulty", **options, faultAt="commitBefore", faultBatch="1")
    # Batch 2's commit reaches the database, then dies before Spark records it: the restart
    # replays batch 2 with the same id, which must be skipped.
    with pytest.raises(Exception, match="injected fault commitAfter b2"):
        run_stream(spark, source, checkpoint, "outbox_faulty", **options, faultAt="commitAfter", faultBatch="2")
    run_stream(spark, source, checkpoint, "outbox", **options)

    assert [p.name.split("-")[:2] for p in sorted(faults.iterdir())] == [["commitAfter", "b2"], ["commitBefore", "b1"]]
    values = [int(v) for _, _, v, _, _ in records(pg, outbox)]
    assert sorted(values) == list(range(FILES * PER_FILE))
    committed = pg.execute(
        sql.SQL("SELECT batch_id, records FROM {} WHERE sink_id = %s ORDER BY batch_id").format(
            SinkTables.of(outbox).commits
        ),
        (options["sinkId"],),
    ).fetchall()
    assert committed == [(b, PER_FILE) for b in range(FILES)]
    assert leftovers(pg, outbox) == (0, 0)

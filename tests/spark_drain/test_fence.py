"""The drain's fencing and planning, called as Spark's driver calls them (real PostgreSQL, no Spark):
a newer copy of the query takes every shard's term and the older one changes nothing after that;
malformed records go to the dead-letter table."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql
from pyspark.sql.streaming.datasource import ReadMaxRows

from harvester.core.protocols import FencedError
from harvester.postgres.schema.catalog import OutboxMissingError
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table
from harvester.postgres.table.rows import malformed
from harvester.spark.drain import DRAIN_SCHEMA, DrainConfigError, DrainOptions, OutboxStreamReader
from harvester.spark.drain.offsets import planned_ids
from harvester.spark.publish import OutboxPublishDataSource
from tests.spark_drain.conftest import preload, remaining
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration


def reader(services: Services, outbox: TableName, **options: str) -> OutboxStreamReader:
    return OutboxStreamReader(DrainOptions.parse({"dsn": services.pg_dsn, "table": outbox.qualified, **options}))


def test_a_newer_query_fences_the_older_one(services: Services, pg: psycopg.Connection[Any], outbox: TableName) -> None:
    ids = preload(pg, outbox, "t", 30, keys=3)
    old, new = reader(services, outbox), reader(services, outbox)
    try:
        planned = old.latestOffset(old.initialOffset(), ReadMaxRows(10))
        assert planned_ids(planned["0"]) == ids[:10]
        taken = new.latestOffset(new.initialOffset(), ReadMaxRows(10))
        assert planned_ids(taken["0"]) == ids[:10] and taken["0"]["epoch"] > planned["0"]["epoch"]

        with pytest.raises(FencedError):
            old.commit(planned)  # its purge is refused: the records stay for the newer query
        assert remaining(pg, outbox) == ids
        with pytest.raises(FencedError):
            old.latestOffset(planned, ReadMaxRows(10))

        (part,) = new.partitions(new.initialOffset(), taken)
        rows = pa.Table.from_batches(list(new.read(part))).to_pylist()
        assert [r["id"] for r in rows] == ids[:10]
        headers = {h["key"]: h["value"] for h in rows[0]["headers"]}
        assert headers["outbox-epoch"] == str(taken["0"]["epoch"]).encode()
        new.commit(taken)
        assert remaining(pg, outbox) == ids[10:]
    finally:
        old.stop()
        new.stop()


def test_a_plan_made_ahead_under_a_term_taken_since_is_fenced(
    services: Services, pg: psycopg.Connection[Any], outbox: TableName
) -> None:
    ids = preload(pg, outbox, "t", 30, keys=3)
    old, new = reader(services, outbox), reader(services, outbox)
    try:
        planned = old.latestOffset(old.initialOffset(), ReadMaxRows(10))
        old.partitions(old.initialOffset(), planned)  # the batch handed out; the next one planned ahead
        old.commit(planned)
        assert remaining(pg, outbox) == ids[10:]
        new.latestOffset(new.initialOffset(), ReadMaxRows(10))  # a second copy takes the term
        with pytest.raises(FencedError):
            old.latestOffset(planned, ReadMaxRows(10))  # the plan made ahead is not taken blindly
        assert remaining(pg, outbox) == ids[10:]
    finally:
        old.stop()
        new.stop()


def test_a_batch_replayed_by_a_restarted_query_dead_letters_under_its_new_term(
    services: Services, pg: psycopg.Connection[Any], outbox: TableName, topics: Callable[..., str]
) -> None:
    good, missing = topics(), unique("missing")  # the brokers do not create topics here
    for n in range(6):
        pg.execute(
            sql.SQL(
                "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys,"
                " kafka_header_values) VALUES (now(), %s, %s, 'v', '{{}}', '{{}}')"
            ).format(outbox.ident),
            (missing if n % 2 else good, f"k{n}"),
        )
    first = reader(services, outbox)
    planned = first.latestOffset(first.initialOffset(), ReadMaxRows(10))
    first.stop()  # the driver dies once the batch is in the offset log, before it ran
    again = reader(services, outbox)  # the restarted query replays it
    kafka = {"kafka.bootstrap.servers": services.bootstrap, "kafka.topic.metadata.propagation.max.ms": "1000"}
    sink = OutboxPublishDataSource({"dsn": services.pg_dsn, "table": outbox.qualified, "maxAttempts": "1", **kafka})
    writer = sink.streamWriter(DRAIN_SCHEMA, overwrite=False)
    try:
        (part,) = again.partitions(first.initialOffset(), planned)
        assert part.term > part.epoch == planned["0"]["epoch"]  # a new term; the records keep their epoch
        writer.commit([writer.write(iter(again.read(part)))], 0)
        again.commit(planned)
        assert remaining(pg, outbox) == []
        letters = pg.execute(sql.SQL("SELECT count(*) FROM {}").format(dead_letter_table(outbox).ident)).fetchone()
        assert letters == (3,)  # dead-lettered under the new term, not lost with the purge
    finally:
        again.stop()


def test_a_dry_outbox_plans_one_empty_batch_to_purge_the_last(
    services: Services, pg: psycopg.Connection[Any], outbox: TableName
) -> None:
    ids = preload(pg, outbox, "t", 5, keys=2)
    drain = reader(services, outbox)
    try:
        first = drain.latestOffset(drain.initialOffset(), ReadMaxRows(10))
        assert planned_ids(first["0"]) == ids
        # Spark commits a batch when it plans the next: with nothing new, the next batch is empty.
        purging = drain.latestOffset(first, ReadMaxRows(10))
        assert planned_ids(purging["0"]) == [] and purging["0"]["batch"] == first["0"]["batch"] + 1
        assert drain.partitions(first, purging) == []
        drain.commit(first)
        assert remaining(pg, outbox) == []
        assert drain.latestOffset(purging, ReadMaxRows(10)) == purging  # nothing to do: no batch
    finally:
        drain.stop()


def test_configuration_mistakes_are_one_line_errors(
    services: Services, pg: psycopg.Connection[Any], outbox: TableName
) -> None:
    with pytest.raises(DrainConfigError, match="option dsn is required"):
        DrainOptions.parse({"table": "outbox"})
    with pytest.raises(DrainConfigError, match="maxRecordsPerTrigger must be a positive integer"):
        DrainOptions.parse({"dsn": "x", "maxRecordsPerTrigger": "0"})
    with pytest.raises(DrainConfigError, match=r"option publish needs kafka\.bootstrap\.servers"):
        DrainOptions.parse({"dsn": "x", "publish": "true"})
    with pytest.raises(DrainConfigError, match="option publish must be true or false, not 'yes'"):
        DrainOptions.parse({"dsn": "x", "publish": "yes"})
    two = reader(services, outbox, shards="2")
    two.latestOffset(two.initialOffset(), ReadMaxRows(10))
    two.stop()
    three = reader(services, outbox, shards="3")
    mismatch = r"^option shards is 3 but t_\w+\.outbox is harvested with 2 shards: use the number its reapers use"
    with pytest.raises(DrainConfigError, match=mismatch):
        three.latestOffset(three.initialOffset(), ReadMaxRows(10))
    with pytest.raises(DrainConfigError, match="checkpoint was written with 2 shards"):
        reader(services, outbox).latestOffset({"shards": 2}, ReadMaxRows(10))
    gone = reader(services, TableName(outbox.schema, "nothing"))
    with pytest.raises(OutboxMissingError, match=r"nothing\W* does not exist \(run 'reaper migrate'\)$"):
        gone.latestOffset(gone.initialOffset(), ReadMaxRows(10))


def test_malformed_records_are_dead_lettered_under_the_fence_and_left_out_of_the_plan(
    services: Services, pg: psycopg.Connection[Any], outbox: TableName
) -> None:
    pg.execute(sql.SQL("ALTER TABLE {} ALTER COLUMN kafka_key DROP NOT NULL").format(outbox.ident))
    before = preload(pg, outbox, "t", 3, keys=2)
    shapes: list[tuple[str | None, list[str | None], list[str | None]]] = [
        (None, [], []),  # NULL key
        ("k0", ["a", "b"], ["1"]),  # header arrays of different lengths
        ("k1", [None], ["1"]),  # a NULL header key
    ]
    bad = [
        int(row[0])
        for key, hkeys, hvalues in shapes
        if (
            row := pg.execute(
                sql.SQL(
                    "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys,"
                    " kafka_header_values) VALUES (now(), 't', %s, 'v', %s, %s) RETURNING id"
                ).format(outbox.ident),
                (key, hkeys, hvalues),
            ).fetchone()
        )
        is not None
    ]
    after = preload(pg, outbox, "t", 2, keys=2)
    drain = reader(services, outbox)
    try:
        planned = drain.latestOffset(drain.initialOffset(), ReadMaxRows(100))
        assert planned_ids(planned["0"]) == before + after  # the query goes on without them
        letters = {
            int(r[0]): tuple(r[1:])
            for r in pg.execute(
                sql.SQL("SELECT id, reason, error, attempts, epoch FROM {}").format(dead_letter_table(outbox).ident)
            )
        }
        epoch = planned["0"]["epoch"]
        # The same reasons a reaper gives (harvester.postgres.table.rows), under the drain's term.
        assert letters == {
            rid: ("malformed", malformed(*shape), 1, epoch) for rid, shape in zip(bad, shapes, strict=True)
        }
        drain.commit(planned)
        assert remaining(pg, outbox) == []
    finally:
        drain.stop()

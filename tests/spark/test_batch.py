"""Batch writes through the ``outbox`` data source: all or nothing, one attempt per partition, order."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import psycopg
import pyarrow as pa
import pytest
from psycopg import sql
from pyspark.sql import SparkSession
from pyspark.sql.types import StringType, StructField, StructType

from harvester.postgres.schema.identifiers import TableName
from harvester.spark import store
from harvester.spark.plan import resolve
from harvester.spark.store import SinkTables, clean_stale
from tests.spark.jobs import newest_first, numbered

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[tuple[object, ...]]


def records(pg: Conn, table: TableName) -> list[tuple[Any, ...]]:
    """(topic, key, value, header keys, header values) of every record, in id order."""
    return pg.execute(
        sql.SQL(
            "SELECT kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values FROM {} ORDER BY id"
        ).format(table.ident)
    ).fetchall()


def leftovers(pg: Conn, table: TableName) -> tuple[int, int]:
    """How many staged rows and task attempts are left behind."""
    names = SinkTables.of(table)
    staged = pg.execute(sql.SQL("SELECT count(*) FROM {}").format(names.staging)).fetchone()
    tasks = pg.execute(sql.SQL("SELECT count(*) FROM {}").format(names.tasks)).fetchone()
    assert staged is not None and tasks is not None
    return int(str(staged[0])), int(str(tasks[0]))


def wait_for_stragglers(pg: Conn, table: TableName, spark: SparkSession | None = None) -> None:
    """Wait until the task attempts still running when Spark aborted a job are gone: they may stage
    rows after the abort's clean-up, and a test that cleans up or drops its schema while they
    write would race them. Spark first (no task of its jobs active), then PostgreSQL (no other
    session has held a lock on the sink's tables for two seconds; a killed worker's session ends
    after its process)."""
    deadline = time.monotonic() + 120
    if spark is not None:
        tracker = spark.sparkContext.statusTracker()
        stages = [s for job in tracker.getJobIdsForGroup() if (info := tracker.getJobInfo(job)) for s in info.stageIds]
        while any((stage := tracker.getStageInfo(s)) and stage.numActiveTasks for s in stages):
            assert time.monotonic() < deadline, "Spark tasks still active two minutes after the job failed"
            time.sleep(0.1)
    relations = [table.quoted, table.derived("spark_tasks").quoted, table.derived("spark_staging").quoted]
    held = "SELECT count(*) FROM pg_locks WHERE pid <> pg_backend_pid() AND relation = ANY(%s::regclass[])"
    quiet_since = time.monotonic()
    while time.monotonic() - quiet_since < 2.0:
        assert time.monotonic() < deadline, "sink tables still locked two minutes after the job failed"
        count = pg.execute(held, [relations]).fetchone()
        if count is not None and count[0]:
            quiet_since = time.monotonic()
        time.sleep(0.1)


def test_retried_task_commits_each_row_once_in_dataframe_order(
    spark: SparkSession, sink: dict[str, str], pg: Conn, outbox: TableName, tmp_path: Path
) -> None:
    # Partition 1's first attempt stages (and commits) all its rows, then fails; Spark retries it.
    (
        numbered(spark, 4000, 4)
        .write.format("outbox_faulty")
        .mode("append")
        .options(**sink, topic="orders", faultAt="stage", faultPartition="1", faultAttempt="0", faultDir=str(tmp_path))
        .save()
    )
    assert [p.name.split("-")[1] for p in tmp_path.iterdir()] == ["p1a0"]
    got = records(pg, outbox)
    assert sorted(int(v) for _, _, v, _, _ in got) == list(range(4000))
    assert {t for t, *_ in got} == {"orders"}
    by_key: dict[str, list[int]] = defaultdict(list)
    for _, key, value, _, _ in got:
        by_key[key].append(int(value))
    assert all(values == sorted(values) for values in by_key.values())
    assert leftovers(pg, outbox) == (0, 0)


def test_speculative_attempt_that_also_staged_its_rows_contributes_nothing(
    sink: dict[str, str], pg: Conn, outbox: TableName
) -> None:
    # Local mode never launches speculative copies (one host), so both attempts of partition 0 run
    # the executor code by hand: each stages successfully, and Spark reports only the winner.
    schema = StructType([StructField("key", StringType()), StructField("value", StringType())])
    plan = resolve({**sink, "topic": "t"}, schema, store.prepare, streaming=False)

    def batches(value: str) -> Iterator[pa.RecordBatch]:
        yield pa.RecordBatch.from_pydict({"key": ["k", "k"], "value": [f"{value}-1", f"{value}-2"]})

    loser = store.stage(plan, batches("original"), partition_id=0, attempt=0)
    winner = store.stage(plan, batches("speculative"), partition_id=0, attempt=1)
    other = store.stage(plan, batches("other"), partition_id=1, attempt=0)
    assert loser.rows == winner.rows == 2 and leftovers(pg, outbox) == (6, 3)
    assert store.publish(plan, [winner, other]) == 4
    assert [v for _, _, v, _, _ in records(pg, outbox)] == ["speculative-1", "speculative-2", "other-1", "other-2"]
    assert leftovers(pg, outbox) == (0, 0)


def test_failed_job_leaves_no_records_and_no_staging(
    spark: SparkSession, sink: dict[str, str], pg: Conn, outbox: TableName, tmp_path: Path
) -> None:
    # Every attempt of partition 1 fails after staging: the job aborts once retries run out.
    with pytest.raises(Exception, match="injected fault"):
        (
            numbered(spark, 1000, 3)
            .write.format("outbox_faulty")
            .mode("append")
            .options(**sink, topic="orders", faultAt="stage", faultPartition="1", faultDir=str(tmp_path))
            .save()
        )
    assert len(list(tmp_path.iterdir())) == 2  # both attempts staged, then failed
    assert records(pg, outbox) == []
    # Tasks of other partitions still running when Spark aborted the job can stage after abort()
    # cleaned up; their rows are stale, and the clean-up every write starts with removes them.
    wait_for_stragglers(pg, outbox, spark)
    clean_stale(pg, outbox, 0)
    assert leftovers(pg, outbox) == (0, 0)


def test_order_column_orders_records_of_a_key(
    spark: SparkSession, sink: dict[str, str], pg: Conn, outbox: TableName
) -> None:
    # The DataFrame holds each key's events newest first; the order column restores event order.
    df = newest_first(spark, 600, 3)
    df.write.format("outbox").mode("append").options(**sink, topic="events", orderColumn="event_time").save()
    by_key: dict[str, list[int]] = defaultdict(list)
    for _, key, value, _, _ in records(pg, outbox):
        by_key[key].append(int(value))
    assert len(by_key) == 5
    assert all(values == sorted(values) and len(values) == 120 for values in by_key.values())


def test_empty_dataframe_commits_nothing(
    spark: SparkSession, sink: dict[str, str], pg: Conn, outbox: TableName
) -> None:
    numbered(spark, 0, 2).write.format("outbox").mode("append").options(**sink, topic="t").save()
    assert records(pg, outbox) == []
    assert leftovers(pg, outbox) == (0, 0)


def test_topic_and_headers_from_columns(spark: SparkSession, sink: dict[str, str], pg: Conn, outbox: TableName) -> None:
    df = spark.createDataFrame(
        [("a.topic", "k1", "v1", {"trace": 'x"1\\'}), ("b_topic", "k2", None, {}), ("a.topic", "k3", "", None)],
        "topic string, key string, value string, headers map<string,string>",
    ).coalesce(1)
    df.write.format("outbox").mode("append").options(**sink, topicColumn="topic", headersColumn="headers").save()
    assert records(pg, outbox) == [
        ("a.topic", "k1", "v1", ["trace"], ['x"1\\']),
        ("b_topic", "k2", None, [], []),
        ("a.topic", "k3", "", [], []),
    ]


# Everything PostgreSQL's text COPY format escapes or treats specially, in every column.
AWKWARD = ["tab\there", "line\nbreak", "carriage\rreturn", "back\\slash", "\\N", "\\x41", 'quote"s', "{br,ace}", "é ✓"]


def test_special_characters_arrive_unchanged(
    spark: SparkSession, sink: dict[str, str], pg: Conn, outbox: TableName
) -> None:
    rows = [(f"k{i}-{text}", text, {text: text}) for i, text in enumerate(AWKWARD)]
    df = spark.createDataFrame(rows, "key string, value string, headers map<string,string>").coalesce(1)
    df.write.format("outbox").mode("append").options(**sink, topic="t", headersColumn="headers").save()
    assert records(pg, outbox) == [("t", key, value, [value], [value]) for key, value, _ in rows]


def test_binary_values_with_every_byte_arrive_unchanged_in_a_bytea_outbox(
    spark: SparkSession, services: Any, pg: Conn, schema: str
) -> None:
    table = TableName(schema, "outbox_bytes")
    pg.execute(
        sql.SQL(
            "CREATE TABLE {} (id BIGSERIAL PRIMARY KEY, create_time TIMESTAMPTZ NOT NULL,"
            " kafka_topic VARCHAR(249) NOT NULL, kafka_key VARCHAR(100) NOT NULL, kafka_value BYTEA,"
            " kafka_header_keys TEXT[] NOT NULL, kafka_header_values TEXT[] NOT NULL, leader_id UUID)"
        ).format(table.ident)
    )
    values = [bytes(range(256)), b"\\N", b"", None]
    df = spark.createDataFrame([(f"k{i}", v) for i, v in enumerate(values)], "key string, value binary")
    df.coalesce(1).write.format("outbox").mode("append").options(
        dsn=services.pg_dsn, table=table.qualified, topic="t"
    ).save()
    assert [row[2] for row in records(pg, table)] == values


def test_header_pairs_and_binary_values_into_bytea_and_jsonb_outboxes(
    spark: SparkSession, services: Any, pg: Conn, schema: str
) -> None:
    df = spark.createDataFrame(
        [("k1", b'{"n": 1}', [("h", "1"), ("h", "2")])],
        "key string, value binary, headers array<struct<key:string,value:string>>",
    )
    for value_type in ("BYTEA", "JSONB", "TEXT"):
        table = TableName(schema, f"outbox_{value_type.lower()}")
        pg.execute(
            sql.SQL(
                "CREATE TABLE {} (id BIGSERIAL PRIMARY KEY, create_time TIMESTAMPTZ NOT NULL DEFAULT now(),"
                " kafka_topic VARCHAR(249) NOT NULL, kafka_key VARCHAR(100) NOT NULL, kafka_value {},"
                " kafka_header_keys TEXT[] NOT NULL, kafka_header_values TEXT[] NOT NULL, leader_id UUID)"
            ).format(table.ident, sql.SQL(value_type))
        )
        df.write.format("outbox").mode("append").options(
            dsn=services.pg_dsn, table=table.qualified, topic="t", headersColumn="headers"
        ).save()
        got = records(pg, table)
        expected = {"BYTEA": b'{"n": 1}', "JSONB": {"n": 1}, "TEXT": '{"n": 1}'}[value_type]
        assert got == [("t", "k1", expected, ["h", "h"], ["1", "2"])], value_type


def test_commit_sql_changes_business_tables_in_the_same_transaction(
    spark: SparkSession, sink: dict[str, str], pg: Conn, outbox: TableName, schema: str
) -> None:
    totals = sql.Identifier(schema, "totals")
    pg.execute(sql.SQL("CREATE TABLE {} (key TEXT PRIMARY KEY, n BIGINT NOT NULL)").format(totals))
    upsert = (
        sql.SQL(
            "INSERT INTO {} SELECT key, count(*) FROM outbox_batch GROUP BY key"
            " ON CONFLICT (key) DO UPDATE SET n = {}.n + excluded.n"
        )
        .format(totals, totals)
        .as_string(pg)
    )
    df = numbered(spark, 70, 2)
    for _ in range(2):
        df.write.format("outbox").mode("append").options(**sink, topic="t", commitSql=upsert).save()
    counted = pg.execute(sql.SQL("SELECT key, n FROM {} ORDER BY key").format(totals)).fetchall()
    assert counted == [(str(k), 20) for k in range(7)]
    # A failing business statement takes the outbox insert down with it.
    with pytest.raises(Exception, match="division by zero"):
        df.write.format("outbox").mode("append").options(**sink, topic="t", commitSql="SELECT 1/0").save()
    assert len(records(pg, outbox)) == 140
    assert leftovers(pg, outbox) == (0, 0)


@pytest.mark.parametrize(
    ("frame", "options", "error"),
    [
        ("key string, value string", {"keyColumn": "id"}, "no key column 'id'"),
        ("key string, value int", {}, "unsupported type int"),
        ("key string, value string", {"topic": "bad topic!"}, "invalid Kafka topic name 'bad topic!'"),
        ("key string, value string", {"topic": None, "topicColumn": "key"}, "invalid Kafka topic name 'k k'"),
        ("key string, value string", {"keyColumn": "value"}, "does not fit the outbox column \\(100 at most\\)"),
    ],
)
def test_bad_input_fails_before_anything_is_committed(
    spark: SparkSession,
    sink: dict[str, str],
    pg: Conn,
    outbox: TableName,
    frame: str,
    options: dict[str, str | None],
    error: str,
) -> None:
    value: Any = 7 if frame.endswith("int") else "x" * 101
    df = spark.createDataFrame([("ok", value), ("k k", value)], frame).coalesce(1)
    settings = {**sink, "topic": "t", **options}
    with pytest.raises(Exception, match=error):
        df.write.format("outbox").mode("append").options(**{k: v for k, v in settings.items() if v}).save()
    assert records(pg, outbox) == []


def stage_by_hand(pg: Conn, table: TableName, rows: int, age: str) -> None:
    """Stage ``rows`` rows for a task attempt that started ``age`` ago, as a write in flight or a
    crashed one leaves them."""
    names = SinkTables.of(table)
    row = pg.execute(
        sql.SQL(
            "INSERT INTO {} (write_id, partition_id, attempt, started_at)"
            " VALUES (gen_random_uuid(), 0, 0, now() - %s::interval) RETURNING task_id"
        ).format(names.tasks),
        (age,),
    ).fetchone()
    assert row is not None
    pg.execute(
        sql.SQL(
            "INSERT INTO {} (task_id, seq, kafka_key, value_text) SELECT %s, g, 'k', 'v' FROM generate_series(1, %s) g"
        ).format(names.staging),
        (row[0], rows),
    )


def test_stale_staging_is_cleaned_up_and_other_writes_are_left_alone(
    spark: SparkSession, sink: dict[str, str], pg: Conn, outbox: TableName
) -> None:
    stage_by_hand(pg, outbox, 5, "2 days")  # a driver that died before its commit
    stage_by_hand(pg, outbox, 3, "1 second")  # another job, still running
    assert leftovers(pg, outbox) == (8, 2)
    numbered(spark, 10, 2).write.format("outbox").mode("append").options(**sink, topic="t").save()
    assert leftovers(pg, outbox) == (3, 1)
    assert sorted(int(v) for _, _, v, _, _ in records(pg, outbox)) == list(range(10))

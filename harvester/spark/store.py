"""The sink's SQL: its tables (through the migrations' ledger), staging a partition, and the single commit
transaction."""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from harvester.postgres.schema import catalog, migrations, privileges
from harvester.postgres.schema.catalog import OutboxColumns
from harvester.postgres.schema.identifiers import TableName
from harvester.spark.encode import PartitionEncoder, staged_value_column, staging_columns
from harvester.spark.plan import SinkConfigError, WritePlan

Conn = psycopg.Connection[tuple[Any, ...]]

# Name of the temporary view through which commitSql sees the rows being committed.
BATCH_VIEW = "outbox_batch"
# How the commitSql view shows a staged value as the outbox's value type (every type the catalog
# accepts); keyed by the catalog's type name, so no type name from the catalog is spliced into SQL.
_VALUE_EXPR = {
    "varchar": sql.SQL("value_text"),
    "text": sql.SQL("value_text"),
    "bpchar": sql.SQL("value_text"),
    "json": sql.SQL("value_text::json"),
    "jsonb": sql.SQL("value_text::jsonb"),
    "bytea": sql.SQL("value_bytes"),
}
# How much of the staged rows' COPY output the commit gathers per write into the outbox's COPY.
_PUMP_BYTES = 1 << 20
_GRANTS = "see 'reaper grants --spark-sink'"


@dataclass(frozen=True, slots=True)
class SinkTables:
    """The quoted names of the sink's own tables next to one outbox table."""

    outbox: sql.Composable
    tasks: sql.Composable
    staging: sql.Composable
    commits: sql.Composable

    @classmethod
    def of(cls, table: TableName) -> SinkTables:
        """The sink tables that belong to ``table`` (named as in ``sql/0005_spark_sink.sql``)."""
        return cls(
            outbox=table.ident,
            tasks=table.derived("spark_tasks").ident,
            staging=table.derived("spark_staging").ident,
            commits=table.derived("spark_commits").ident,
        )


def prepare(dsn: str, table: TableName, retention_seconds: int) -> OutboxColumns:
    """Driver side, before a write: refuse a role that lacks a grant the write needs
    (:class:`SinkConfigError` naming every GRANT missing, in one line: nothing staged, nothing
    committed), describe the outbox, create the sink tables if needed, and drop rows staged more
    than ``retention_seconds`` ago."""
    with psycopg.connect(dsn, autocommit=True) as conn:
        needs, serials = privileges.spark_sink_needs(table), privileges.spark_sink_serials(table)
        problems = privileges.lacking(conn, table.schema or "public", needs, _GRANTS, serials)
        if problems:
            raise SinkConfigError("; ".join(problems))
        columns = catalog.read(conn, table)
        # Applied through the ledger, so the data source works without ``reaper migrate``.
        migrations.ensure(conn, table, "spark_sink")
        clean_stale(conn, table, retention_seconds)
        return columns


def clean_stale(conn: Conn, table: TableName, older_than_seconds: int) -> int:
    """Delete what tasks staged more than ``older_than_seconds`` ago (crashed or abandoned writes);
    return the number of task attempts removed."""
    names = SinkTables.of(table)
    with conn.transaction():
        stale = conn.execute(
            sql.SQL("DELETE FROM {} WHERE started_at < now() - make_interval(secs => %s) RETURNING task_id").format(
                names.tasks
            ),
            (older_than_seconds,),
        ).fetchall()
        if stale:
            conn.execute(
                sql.SQL("DELETE FROM {} WHERE task_id = ANY(%s)").format(names.staging), ([r[0] for r in stale],)
            )
    return len(stale)


@dataclass(frozen=True, slots=True)
class Staged:
    """What one task attempt staged (``task_id`` is None when its partition was empty)."""

    write_id: str
    task_id: int | None
    partition_id: int
    attempt: int
    rows: int


def stage(plan: WritePlan, batches: Iterator[Any], partition_id: int, attempt: int) -> Staged:
    """Executor side: COPY one partition into the staging table, in one transaction of its own.

    The connection is opened only once a non-empty batch arrives, so that empty partitions (common
    in small micro-batches) cost nothing.
    """
    encoder = PartitionEncoder(plan, partition_id)
    first = next((b for b in batches if b.num_rows), None)
    if first is None:
        return Staged(plan.write_id, None, partition_id, attempt, 0)
    names = SinkTables.of(plan.table)
    copy = sql.SQL("COPY {} ({}) FROM STDIN").format(
        names.staging, sql.SQL(", ").join(map(sql.Identifier, staging_columns(plan)))
    )
    with psycopg.connect(plan.dsn) as conn:
        row = conn.execute(
            sql.SQL("INSERT INTO {} (write_id, partition_id, attempt) VALUES (%s, %s, %s) RETURNING task_id").format(
                names.tasks
            ),
            (plan.write_id, partition_id, attempt),
        ).fetchone()
        assert row is not None
        task_id = int(row[0])
        with conn.cursor().copy(copy) as pipe:
            pipe.write(encoder.encode(first, task_id))
            for batch in batches:
                if batch.num_rows:
                    pipe.write(encoder.encode(batch, task_id))
        conn.commit()
    return Staged(plan.write_id, task_id, partition_id, attempt, encoder.rows)


def _batch_view(plan: WritePlan, task_ids: list[int]) -> sql.Composed:
    names = SinkTables.of(plan.table)
    topic: sql.Composable = sql.Literal(plan.topic) if plan.topic is not None else sql.SQL("kafka_topic")
    return sql.SQL(
        "CREATE TEMP VIEW {view} AS SELECT {topic}::text AS topic, kafka_key AS key, {value} AS value,"
        " COALESCE(header_keys, '{{}}') AS header_keys, COALESCE(header_values, '{{}}') AS header_values,"
        " sort_number, sort_text, seq, now() AS create_time FROM {staging} WHERE task_id = ANY({tasks}::bigint[])"
    ).format(
        view=sql.Identifier(BATCH_VIEW),
        topic=topic,
        value=_VALUE_EXPR[plan.columns.value_type],
        staging=names.staging,
        tasks=sql.Literal(task_ids),
    )


def _order(plan: WritePlan) -> sql.Composable:
    if plan.sort_kind == "number":
        return sql.SQL("sort_number, seq")
    if plan.sort_kind == "text":
        return sql.SQL("sort_text, seq")
    return sql.SQL("seq")


def _copy_pair(plan: WritePlan, task_ids: list[int]) -> tuple[sql.Composed, sql.Composed]:
    """``COPY … TO STDOUT`` of the staged rows in commit order, and the ``COPY … FROM STDIN`` of
    the outbox that takes its output as it is (both in the text format).

    ``create_time`` is written, not left to a default: goharvest's table declares it NOT NULL
    without one. Its text is PostgreSQL's special input ``now``, which the outbox's COPY reads as
    the start time of the commit transaction, i.e. that transaction's ``now()``: one timestamp for
    every row of the write, as a ``DEFAULT now()`` gives, whatever either session's ``TimeZone`` or
    ``DateStyle``. A literal timestamp would mean the same but cost the COPY a full timestamp parse
    per row (a quarter more commit time for a million rows); ``now`` costs a keyword lookup.
    """
    names = SinkTables.of(plan.table)
    columns = ["create_time", "kafka_topic", "kafka_key", "kafka_value"]
    # Without headers, the columns' defaults are far cheaper than parsing '{}' twice per row.
    headers = ""
    if plan.headers_column is not None or not plan.columns.header_defaults:
        columns += ["kafka_header_keys", "kafka_header_values"]
        headers = ", COALESCE(header_keys, '{}'), COALESCE(header_values, '{}')"
    source = sql.SQL(
        "COPY (SELECT 'now'::text, {topic}, kafka_key, {value}{headers} FROM {staging}"
        " WHERE task_id = ANY({tasks}::bigint[]) ORDER BY {order}) TO STDOUT"
    ).format(
        topic=sql.Literal(plan.topic) if plan.topic is not None else sql.SQL("kafka_topic"),
        value=sql.Identifier(staged_value_column(plan)),
        headers=sql.SQL(headers),
        staging=names.staging,
        tasks=sql.Literal(task_ids),
        order=_order(plan),
    )
    sink = sql.SQL("COPY {} ({}) FROM STDIN").format(names.outbox, sql.SQL(", ").join(map(sql.Identifier, columns)))
    return source, sink


def _move_staged(conn: Conn, plan: WritePlan, task_ids: list[int]) -> int:
    """Stream the staged rows, sorted by a second connection, into the outbox through ``conn``'s
    transaction; return the number of rows inserted.

    COPY in, rather than ``INSERT … SELECT``, because PostgreSQL inserts COPY's rows in batches and
    an ``INSERT … SELECT``'s one at a time. The reader runs in autocommit, so its lock on the
    staging table is gone when its COPY ends.
    """
    source, sink = _copy_pair(plan, task_ids)
    with psycopg.connect(plan.dsn, autocommit=True) as reader:
        # The sort of the whole write happens here: in memory, and without JIT, which costs more
        # than it saves on this plan.
        reader.execute("SELECT set_config('work_mem', %s, false), set_config('jit', 'off', false)", (plan.work_mem,))
        with reader.cursor().copy(source) as rows, conn.cursor() as cur:
            with cur.copy(sink) as outbox:
                pending = bytearray()
                for chunk in rows:
                    pending += chunk
                    if len(pending) >= _PUMP_BYTES:
                        outbox.write(pending)
                        pending = bytearray()
                outbox.write(pending)
            return cur.rowcount


def publish(plan: WritePlan, messages: Iterable[Staged | None], batch_id: int | None = None) -> int | None:
    """Driver side: move the staged rows into the outbox in one transaction.

    Exactly one attempt per partition is taken (the ones Spark reported in ``messages``); rows of
    other attempts are deleted with the write. For a streaming sink, ``(sink_id, batch_id)`` is
    recorded in the same transaction and a batch already recorded is skipped: the return value is
    then None, otherwise the number of records inserted.
    """
    staged = list(messages)
    if any(m is None for m in staged):
        raise RuntimeError("a task reported no commit message; refusing to commit a partial write")
    done = [m for m in staged if m is not None]
    task_ids = [m.task_id for m in done if m.task_id is not None]
    expected = sum(m.rows for m in done)
    write_ids = sorted({plan.write_id, *(m.write_id for m in done)})
    names = SinkTables.of(plan.table)
    with psycopg.connect(plan.dsn) as conn, conn.transaction():
        inserted: int | None = None
        fresh = True
        if batch_id is not None:
            row = conn.execute(
                sql.SQL(
                    "INSERT INTO {} (sink_id, batch_id, records) VALUES (%s, %s, %s)"
                    " ON CONFLICT (sink_id, batch_id) DO NOTHING RETURNING batch_id"
                ).format(names.commits),
                (plan.sink_id, batch_id, expected),
            ).fetchone()
            fresh = row is not None
        if fresh:
            inserted = _move_staged(conn, plan, task_ids) if task_ids else 0
            if inserted != expected:
                raise RuntimeError(
                    f"found {inserted} staged rows where the tasks reported {expected}; were they removed as stale "
                    "(stagingRetentionSeconds)? Nothing was committed"
                )
            if plan.commit_sql is not None:
                conn.execute(_batch_view(plan, task_ids))
                conn.execute(plan.commit_sql.encode("utf-8"))
                conn.execute(sql.SQL("DROP VIEW {}").format(sql.Identifier(BATCH_VIEW)))
        _delete_writes(conn, names, write_ids)
    return inserted


def _delete_writes(conn: Conn, names: SinkTables, write_ids: list[str]) -> None:
    if _truncate_if_alone(conn, names, write_ids):
        return
    conn.execute(
        sql.SQL("DELETE FROM {} WHERE task_id IN (SELECT task_id FROM {} WHERE write_id = ANY(%s::uuid[]))").format(
            names.staging, names.tasks
        ),
        (write_ids,),
    )
    conn.execute(sql.SQL("DELETE FROM {} WHERE write_id = ANY(%s::uuid[])").format(names.tasks), (write_ids,))


def _truncate_if_alone(conn: Conn, names: SinkTables, write_ids: list[str]) -> bool:
    """TRUNCATE the staging table when it holds nothing but these writes' rows: far cheaper than
    deleting a million rows. Only if the lock is free at once (no other write is staging or
    committing); the savepoint keeps a refused lock from aborting the commit transaction."""
    try:
        with conn.transaction():
            conn.execute(sql.SQL("LOCK TABLE {} IN ACCESS EXCLUSIVE MODE NOWAIT").format(names.staging))
    except psycopg.errors.LockNotAvailable:
        return False
    # With the lock held no task can stage; any other write's committed rows show in the tasks table.
    others = conn.execute(
        sql.SQL("SELECT EXISTS (SELECT 1 FROM {} WHERE write_id <> ALL(%s::uuid[]))").format(names.tasks), (write_ids,)
    ).fetchone()
    if others is None or others[0]:
        return False
    conn.execute(sql.SQL("TRUNCATE {}").format(names.staging))
    conn.execute(sql.SQL("DELETE FROM {} WHERE write_id = ANY(%s::uuid[])").format(names.tasks), (write_ids,))
    return True


def discard(plan: WritePlan, messages: Iterable[Staged | None]) -> None:
    """Driver side, on abort: delete everything the write staged; the outbox is untouched."""
    write_ids = sorted({plan.write_id, *(m.write_id for m in messages if m is not None)})
    with psycopg.connect(plan.dsn) as conn, conn.transaction():
        _delete_writes(conn, SinkTables.of(plan.table), write_ids)

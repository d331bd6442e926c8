"""The ``outbox`` sink's commit alone, at several sizes, without Spark or a harvester: where its time goes.

    .venv/bin/python bench/spark_commit.py [--sizes 1000000,5000000] [--work-mem 256MB]

For each size, rows are staged server-side (``generate_series``, two tasks as two partitions, the
same shape as ``bench/spark_write.py``'s: key ``key-<n % 1000>``, a ~45 character JSON value), then:

- ``EXPLAIN (ANALYZE, BUFFERS)`` of the commit's sorted read of the staging table (is the sort in
  memory at ``--work-mem``, or spilled to temporary files?);
- the commit itself, through the sink's own ``publish`` (one transaction: the sorted read piped into
  the outbox's COPY, then the staging rows' removal), with the WAL it wrote, the checkpoints that
  ran meanwhile and the temporary bytes the database reported.

Needs the local PostgreSQL (``deploy/local/services.sh start``); prints figures only.
"""

from __future__ import annotations

import argparse
import os
import sys
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql
from pyspark.sql.types import StringType, StructField, StructType

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import migrate
from harvester.spark.plan import resolve
from harvester.spark.store import SinkTables, Staged, prepare, publish

PG_DSN = os.environ.get(
    "HARVESTER_TEST_PG_DSN", "host=127.0.0.1 port=5432 user=harvester password=local-dev-secret dbname=harvester"
)
SCHEMA = StructType([StructField("key", StringType()), StructField("value", StringType())])
Conn = psycopg.Connection[tuple[object, ...]]


def counters(conn: Conn) -> tuple[str, int, int]:
    """The WAL position, checkpoints so far and temporary bytes written so far."""
    row = conn.execute(
        "SELECT pg_current_wal_lsn()::text, (SELECT checkpoints_req + checkpoints_timed FROM pg_stat_bgwriter),"
        " (SELECT temp_bytes FROM pg_stat_database WHERE datname = current_database())"
    ).fetchone()
    assert row is not None
    return str(row[0]), int(str(row[1])), int(str(row[2]))


def at_size(conn: Conn, rows: int, work_mem: str) -> None:
    """Stage ``rows`` rows into a fresh outbox's staging table, explain the read, time the commit."""
    schema = "bench_commit_" + uuid.uuid4().hex[:8]
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(schema)))
    try:
        table = TableName(schema, "outbox")
        migrate(conn, table)
        options = {"dsn": PG_DSN, "table": table.qualified, "topic": "bench", "commitWorkMem": work_mem}
        plan = resolve(options, SCHEMA, prepare, streaming=False)
        names = SinkTables.of(table)
        staged = []
        for partition in range(2):
            task = conn.execute(
                sql.SQL("INSERT INTO {} (write_id, partition_id, attempt) VALUES (%s, %s, 0) RETURNING task_id").format(
                    names.tasks
                ),
                (plan.write_id, partition),
            ).fetchone()
            assert task is not None
            task_id, half = int(str(task[0])), rows // 2
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (task_id, seq, kafka_key, value_text) SELECT %s, (%s::bigint << 40) + n,"
                    " 'key-' || (n %% 1000), '{{\"n\": ' || n || ', \"payload\": \"abcdefghijklmnopqrstu\"}}'"
                    " FROM generate_series(0, %s - 1) n"
                ).format(names.staging),
                (task_id, partition, half),
            )
            staged.append(Staged(plan.write_id, task_id, partition, 0, half))
        conn.execute(sql.SQL("VACUUM ANALYZE {}").format(names.staging))

        print(f"{rows:,} rows, work_mem {work_mem}: the commit's sorted read")
        conn.execute("SELECT set_config('work_mem', %s, false), set_config('jit', 'off', false)", (work_mem,))
        read = sql.SQL(
            "EXPLAIN (ANALYZE, BUFFERS) SELECT 'now'::text, 'bench', kafka_key, value_text FROM {}"
            " WHERE task_id = ANY(%s::bigint[]) ORDER BY seq"
        ).format(names.staging)
        for (line,) in conn.execute(read, ([s.task_id for s in staged],)).fetchall():
            print(f"    {line}")

        (lsn, checkpoints, temp), started = counters(conn), time.monotonic()
        inserted = publish(plan, staged)
        elapsed = time.monotonic() - started
        time.sleep(1)  # statistics reach the shared counters within a second
        lsn2, checkpoints2, temp2 = counters(conn)
        wal = conn.execute("SELECT pg_wal_lsn_diff(%s, %s)", (lsn2, lsn)).fetchone()
        assert inserted == rows and wal is not None
        print(
            f"  commit: {elapsed:.1f} s ({rows / elapsed:,.0f} rows/s), WAL {float(str(wal[0])) / 2**20:,.0f} MB,"
            f" {checkpoints2 - checkpoints} checkpoint(s), temporary files {(temp2 - temp) / 2**20:,.0f} MB"
        )
    finally:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(schema)))


def main() -> None:
    """Parse the arguments, run every size."""
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0] if __doc__ else None)
    parser.add_argument("--sizes", default="1000000,5000000", help="comma-separated numbers of rows")
    parser.add_argument("--work-mem", default="256MB", help="the sink's commitWorkMem")
    args = parser.parse_args()
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        settings = conn.execute(
            "SELECT string_agg(name || '=' || current_setting(name), ', ' ORDER BY name) FROM pg_settings"
            " WHERE name IN ('shared_buffers', 'max_wal_size', 'max_parallel_workers_per_gather')"
        ).fetchone()
        print(f"server: {settings[0] if settings else '?'}")
        for rows in (int(n) for n in args.sizes.split(",")):
            at_size(conn, rows, args.work_mem)


if __name__ == "__main__":
    main()

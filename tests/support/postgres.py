"""PostgreSQL helpers: a session whose transactions the server streams, how many it streamed, and
goharvest's own outbox table."""

from __future__ import annotations

from typing import Any

import psycopg
from psycopg import sql
from psycopg.conninfo import make_conninfo

from harvester.postgres.schema.identifiers import TableName


def streaming(dsn: str) -> str:
    """``dsn`` whose sessions have the server stream any transaction of more than 64 kB of changes
    while it is in progress (``logical_decoding_work_mem`` at its least; harvester/postgres/log/streamed.py)."""
    return make_conninfo(dsn, options="-c logical_decoding_work_mem=64kB")


def streamed_transactions(dsn: str, slot: str | None = None) -> int:
    """How many transactions the server has streamed in progress to ``slot`` (or to every slot),
    since its last restart."""
    query = (
        "SELECT coalesce(sum(stream_txns), 0) FROM pg_stat_replication_slots WHERE %s::text IS NULL OR slot_name = %s"
    )
    with psycopg.connect(dsn, autocommit=True) as conn:
        row = conn.execute(query, (slot, slot)).fetchone()
    return 0 if row is None else int(row[0])


# goharvest's outbox DDL, word for word: nothing but id has a default.
GOHARVEST_DDL = """
CREATE TABLE IF NOT EXISTS {} (
  id                  BIGSERIAL PRIMARY KEY,
  create_time         TIMESTAMP WITH TIME ZONE NOT NULL,
  kafka_topic         VARCHAR(249) NOT NULL,
  kafka_key           VARCHAR(100) NOT NULL,
  kafka_value         VARCHAR(10000),
  kafka_header_keys   TEXT[] NOT NULL,
  kafka_header_values TEXT[] NOT NULL,
  leader_id           UUID
)
"""


def create_goharvest_outbox(conn: psycopg.Connection[Any], table: TableName) -> None:
    """Create ``table`` exactly as goharvest's own DDL does (never migrated by this project)."""
    conn.execute(sql.SQL(GOHARVEST_DDL).format(table.ident))

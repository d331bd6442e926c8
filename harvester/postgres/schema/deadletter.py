"""Operator tools for dead letters: list, show, replay into the outbox, purge.

Every function works in the caller's connection and transaction, so the CLI can confirm first and
commit once.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import datetime
from typing import Any

import psycopg
from psycopg import sql
from psycopg.rows import dict_row

from harvester.core.records import OutboxRecord
from harvester.postgres.schema import message_format
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table

_SUMMARY = "id, kafka_topic, kafka_key, reason, attempts, first_failure, last_failure, dead_lettered_at"


def _dlq(table: TableName) -> sql.Composable:
    return dead_letter_table(table).ident


def exists(conn: psycopg.Connection[Any], table: TableName) -> bool:
    """Whether the dead-letter table exists yet (it is created by migration or on first use)."""
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (dead_letter_table(table).quoted,)).fetchone()
    return bool(row and row[0])


def tables_exist(conn: psycopg.Connection[Any], table: TableName) -> tuple[bool, bool]:
    """Whether the outbox table and its dead-letter table exist, in one catalog query."""
    row = conn.execute(
        "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
        (table.quoted, dead_letter_table(table).quoted),
    ).fetchone()
    return (bool(row[0]), bool(row[1])) if row else (False, False)


def missing_ids(conn: psycopg.Connection[Any], table: TableName, ids: Sequence[int]) -> list[int]:
    """Those of ``ids`` that are not dead letters (all of them when there is no dead-letter table)."""
    if not exists(conn, table):
        return sorted(set(ids))
    rows = conn.execute(
        sql.SQL("SELECT id FROM {} WHERE id = ANY(%s::bigint[])").format(_dlq(table)), (list(ids),)
    ).fetchall()
    return sorted(set(ids) - {int(r[0]) for r in rows})


def list_dead_letters(conn: psycopg.Connection[Any], table: TableName, limit: int = 100) -> list[dict[str, Any]]:
    """The oldest ``limit`` dead letters, without their values."""
    if not exists(conn, table):
        return []
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(
            sql.SQL("SELECT " + _SUMMARY + " FROM {} ORDER BY id LIMIT %s").format(_dlq(table)), (limit,)
        ).fetchall()


def show(conn: psycopg.Connection[Any], table: TableName, record_id: int) -> dict[str, Any] | None:
    """One dead letter with everything kept about it."""
    if not exists(conn, table):
        return None
    with conn.cursor(row_factory=dict_row) as cur:
        return cur.execute(sql.SQL("SELECT * FROM {} WHERE id = %s").format(_dlq(table)), (record_id,)).fetchone()


def replay(
    conn: psycopg.Connection[Any], table: TableName, ids: Sequence[int] | None, *, held_keys: bool = False
) -> list[int]:
    """Move dead letters (``None``: all) back into the outbox with new ids, in their original
    order, so records of one key keep their order relative to each other; return the new ids.

    ``held_keys`` (for ``dead_letter_policy: hold_key``): the records that waited behind each
    replayed key are moved behind the replayed ones, so the key's order is what it was.
    """
    if not exists(conn, table):
        return []
    where = sql.SQL("") if ids is None else sql.SQL(" WHERE id = ANY(%s::bigint[])")
    params: tuple[Any, ...] = () if ids is None else (list(ids),)
    followers = sql.SQL(
        ", waiting AS (DELETE FROM {t} WHERE kafka_key IN (SELECT kafka_key FROM moved) RETURNING *)"
        if held_keys
        else ", waiting AS (SELECT * FROM {t} WHERE false)"
    ).format(t=table.ident)
    columns = "kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values"
    rows = conn.execute(
        sql.SQL(
            "WITH moved AS (DELETE FROM {d}{w} RETURNING *){f} "
            "INSERT INTO {t} (create_time, " + columns + ")"
            " SELECT create_time, " + columns + " FROM ("
            " SELECT 0 AS batch, id, now() AS create_time, " + columns + " FROM moved"
            " UNION ALL SELECT 1, id, create_time, " + columns + " FROM waiting) r"
            " ORDER BY batch, id RETURNING id"
        ).format(d=_dlq(table), w=where, f=followers, t=table.ident),
        params,
    ).fetchall()
    return sorted(int(r[0]) for r in rows)


def replay_messages(
    conn: psycopg.Connection[Any], table: TableName, ids: Sequence[int] | None, prefix: str
) -> list[int]:
    """A table-less outbox's :func:`replay`: the dead letters, in their original order, written again
    as logical messages with ``prefix`` (a payload that never parsed goes as it was); return the new
    messages' LSNs (their ids)."""
    if not exists(conn, table):
        return []
    where = sql.SQL("") if ids is None else sql.SQL(" WHERE id = ANY(%s::bigint[])")
    params: tuple[Any, ...] = () if ids is None else (list(ids),)
    moved = conn.execute(
        sql.SQL(
            "DELETE FROM {}{} RETURNING id, kafka_topic, kafka_key, kafka_value, kafka_header_keys, kafka_header_values"
        ).format(_dlq(table), where),
        params,
    ).fetchall()
    payloads = []
    for _, topic, key, value, hkeys, hvalues in sorted(moved, key=lambda r: int(r[0])):
        if not topic:  # the payload did not parse: its raw bytes
            payloads.append(bytes(value or b""))
            continue
        headers = list(zip(hkeys or (), hvalues or (), strict=False))
        payloads.append(message_format.encode(OutboxRecord.of(topic, key or "", value, headers)))
    rows = conn.execute(
        "SELECT pg_wal_lsn_diff(pg_logical_emit_message(true, %s, p), '0/0')::bigint FROM unnest(%s::bytea[]) AS p",
        (prefix, payloads),
    ).fetchall()
    return [int(r[0]) for r in rows]


def purge(conn: psycopg.Connection[Any], table: TableName, before: datetime) -> int:
    """Delete dead letters dead-lettered before ``before``; return how many."""
    if not exists(conn, table):
        return 0
    cur = conn.execute(sql.SQL("DELETE FROM {} WHERE dead_lettered_at < %s").format(_dlq(table)), (before,))
    return cur.rowcount

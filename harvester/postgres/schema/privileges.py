"""The privileges a role needs on an outbox's tables, and those the connected role lacks, each as one
line naming the GRANT that fixes it: what ``reaper check`` and ``reaper run`` say of the reaper's role
(``harvester/daemon/access.py``), and the Spark sink of its writer's before a row moves
(``harvester/spark/store.py``). ``reaper grants`` prints the grants themselves (``harvester/daemon/grants.py``)."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass
from typing import Any

from harvester.postgres.schema.identifiers import TableName


@dataclass(frozen=True)
class Need:
    """Privileges a role needs on one table, and what for."""

    table: TableName
    privileges: tuple[str, ...]
    why: str


def spark_sink_needs(table: TableName) -> list[Need]:
    """What a role that writes into ``table`` through Spark's ``format("outbox")`` sink needs
    (``harvester/spark/store.py``), once the owner's ``reaper migrate`` made the sink's tables."""
    return [
        Need(
            TableName(table.schema, "harvester_migrations"),
            ("SELECT",),
            "the migrations' ledger: whether the sink's tables are in place",
        ),
        Need(table, ("INSERT",), "the outbox: the commit's COPY of the staged rows"),
        Need(
            table.derived("spark_tasks"),
            ("SELECT", "INSERT", "DELETE"),
            "one row per task attempt; removed with its write, or as stale",
        ),
        Need(
            table.derived("spark_staging"),
            ("SELECT", "INSERT", "DELETE", "TRUNCATE"),
            "the executors' COPY; emptied by the commit (a TRUNCATE when no other write stages)",
        ),
        Need(
            table.derived("spark_commits"),
            ("SELECT", "INSERT"),
            "a streaming sink's committed batch ids (INSERT ... ON CONFLICT DO NOTHING RETURNING)",
        ),
    ]


def spark_sink_serials(table: TableName) -> list[tuple[TableName, str]]:
    """The serial columns whose sequences a Spark sink's writer draws from: the outbox's ids and the task attempts'."""
    return [(table, "id"), (table.derived("spark_tasks"), "task_id")]


def lacking(
    conn: Any, schema: str, needs: Iterable[Need], hint: str, serials: Iterable[tuple[TableName, str]] = ()
) -> list[str]:
    """The privileges of ``needs`` the connected role lacks on tables that exist, and USAGE on the
    sequences behind ``serials`` (table, column), one line each naming the GRANT, ``hint`` in
    parentheses after it; only the schema's USAGE when the role lacks that."""
    role = conn.info.user
    # No row: the schema is absent, as its tables are (the caller says so where it reads them).
    row = conn.execute("SELECT has_schema_privilege(oid, 'USAGE') FROM pg_namespace WHERE nspname = %s", (schema,))
    usage = row.fetchone()
    if usage is None:
        return []
    if not usage[0]:
        return [f"role {role} lacks USAGE on schema {schema}: GRANT USAGE ON SCHEMA {schema} TO {role} ({hint})"]
    problems: list[str] = []
    for need in needs:
        if conn.execute("SELECT to_regclass(%s)", (need.table.quoted,)).fetchone()[0] is None:
            continue  # absent: the caller says so where it reads the table, or creates it
        lacks = [
            p
            for p in need.privileges
            if not conn.execute("SELECT has_table_privilege(%s, %s)", (need.table.quoted, p)).fetchone()[0]
        ]
        if lacks:
            grant = f"GRANT {', '.join(lacks)} ON {need.table.qualified} TO {role}"
            problems.append(f"role {role} lacks {', '.join(lacks)} on {need.table.qualified}: {grant} ({hint})")
    for table, column in serials:
        if conn.execute("SELECT to_regclass(%s)", (table.quoted,)).fetchone()[0] is None:
            continue
        row = conn.execute(  # no row: no such column, or none with a sequence behind it
            "SELECT s, has_sequence_privilege(s, 'USAGE') FROM (SELECT pg_get_serial_sequence(%s, attname) s"
            " FROM pg_attribute WHERE attrelid = %s::regclass AND attname = %s AND NOT attisdropped) q"
            " WHERE s IS NOT NULL",
            (table.quoted, table.quoted, column),
        ).fetchone()
        if row is not None and not row[1]:
            grant = f"GRANT USAGE ON SEQUENCE {row[0]} TO {role}"
            problems.append(f"role {role} lacks USAGE on sequence {row[0]}: {grant} ({hint})")
    return problems

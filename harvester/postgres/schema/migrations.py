"""Applies the migrations of the top-level ``sql/`` to one outbox table, idempotently.

Each file is a template over the outbox table's name; applied versions are recorded per table in
``harvester_migrations`` (in the outbox's schema), under an advisory lock so concurrent runs are
safe. Existing data is never touched: migrations only create what is absent. ``reaper migrate``
applies them all; a feature that needs some of them on a table never migrated applies those
through the same ledger (:func:`ensure`), never at the start of a leadership term.
"""

from __future__ import annotations

import time
from dataclasses import dataclass
from importlib import resources
from importlib.resources.abc import Traversable
from pathlib import Path
from string import Template
from typing import Literal

import psycopg
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.sharding import shard_expression, shard_index

LOCK_KEY = 0x6F7574626F78  # "outbox": serialises concurrent migrations of any table
_INDEX_LOCK_KEY = LOCK_KEY + 1  # serialises the shard index builds of concurrent starts

Feature = Literal["fence", "dead_letter", "spark_sink"]
# The migrations each optional feature needs; :func:`ensure` applies them on first use.
FEATURES: dict[Feature, tuple[str, ...]] = {
    "fence": (
        "0003_fence",
        "0007_checkpoint",
        "0009_fence_shards",
        "0010_fence_log_position",
        "0011_fence_log_partial",
        "0012_fence_log_recovery",
    ),
    "dead_letter": ("0006_dead_letter", "0008_dead_letter_key_index"),
    "spark_sink": ("0005_spark_sink",),
}


class _SqlTemplate(Template):
    # Only ${name} is a placeholder, so PL/pgSQL's $tag$ quoting passes through untouched.
    pattern = r"\$(?:(?P<escaped>(?!))|(?P<named>(?!))|\{(?P<braced>[a-z_]+)\}|(?P<invalid>(?!)))"  # type: ignore[assignment]


@dataclass(frozen=True, slots=True)
class Migration:
    """One numbered SQL file."""

    version: str
    text: str


def notify_channel(table: TableName) -> str:
    """The LISTEN/NOTIFY channel the outbox trigger notifies."""
    return f"{table.qualified.replace('.', '__')}_harvest"[:63]


def fence_table(table: TableName) -> TableName:
    """The fence table shared by the outbox tables of ``table``'s schema."""
    return TableName(table.schema, "harvester_fence")


def dead_letter_table(table: TableName) -> TableName:
    """The dead-letter table of an outbox table."""
    return table.derived("dead_letter")


def _value_type(table: TableName, conn: psycopg.Connection[tuple[object, ...]]) -> str:
    """The outbox's kafka_value type, so dead letters keep values byte for byte (varchar if absent)."""
    row = conn.execute(
        "SELECT format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attname = 'kafka_value' AND NOT attisdropped",
        (table.quoted,),
    ).fetchone()
    return str(row[0]) if row else "VARCHAR(10000)"


def _directory() -> Traversable:
    """Where the migrations are: the top-level ``sql/`` of a checkout (their one home), which the
    wheel installs as the package data ``harvester/postgres/sql/`` (setup.py)."""
    installed = resources.files("harvester.postgres") / "sql"
    if installed.is_dir():
        return installed
    return Path(str(resources.files("harvester"))).parent / "sql"


def available() -> list[Migration]:
    """The migrations shipped with the package, in order."""
    root = _directory()
    files = sorted((p for p in root.iterdir() if p.name.endswith(".sql")), key=lambda p: p.name)
    if not files:
        raise RuntimeError(f"no migrations (*.sql) in {root}")
    return [Migration(p.name.removesuffix(".sql"), p.read_text("utf-8")) for p in files]


def render(
    migration: Migration, table: TableName, conn: psycopg.Connection[tuple[object, ...]], value_type: str | None = None
) -> str:
    """Substitute the table's quoted names into a migration's text (``value_type``: the dead
    letters' value type, else the outbox's)."""

    def q(c: sql.Composable) -> str:
        return c.as_string(conn)

    channel = notify_channel(table)
    return _SqlTemplate(migration.text).substitute(
        table=q(table.ident),
        table_literal=q(sql.Literal(table.qualified)),
        notify_fn=q(table.derived("harvest_notify").ident),
        notify_trigger=q(sql.Identifier(f"{table.name}_harvest_notify"[:63])),
        channel=channel,
        channel_literal=q(sql.Literal(channel)),
        fence=q(fence_table(table).ident),
        fence_literal=q(sql.Literal(fence_table(table).quoted)),
        dead_letter=q(dead_letter_table(table).ident),
        dead_letter_key_index=q(sql.Identifier(f"{table.name}_dead_letter_key_idx"[:63])),
        # Only the dead-letter migration needs it: spare the other migrations the catalog query.
        value_type=value_type or (_value_type(table, conn) if "${value_type}" in migration.text else ""),
        spark_tasks=q(table.derived("spark_tasks").ident),
        spark_tasks_write_idx=q(sql.Identifier(f"{table.name}_spark_tasks_write_idx"[:63])),
        spark_staging=q(table.derived("spark_staging").ident),
        spark_commits=q(table.derived("spark_commits").ident),
    )


_SCHEMA_EXISTS = "SELECT 1 FROM pg_namespace WHERE nspname = %s"


def _ledger(table: TableName) -> sql.Composable:
    if table.schema:
        return sql.Identifier(table.schema, "harvester_migrations")
    return sql.Identifier("harvester_migrations")


def _recorded(conn: psycopg.Connection[tuple[object, ...]], table: TableName) -> set[str]:
    """The versions the ledger records for ``table`` (none when there is no ledger yet)."""
    ledger = _ledger(table)
    exists = conn.execute("SELECT to_regclass(%s)", (ledger.as_string(conn),)).fetchone()
    if exists is None or exists[0] is None:
        return set()
    rows = conn.execute(sql.SQL("SELECT version FROM {} WHERE table_name = %s").format(ledger), (table.qualified,))
    return {str(r[0]) for r in rows}


def _apply(
    conn: psycopg.Connection[tuple[object, ...]],
    table: TableName,
    wanted: list[Migration],
    value_type: str | None = None,
) -> list[str]:
    """Apply those of ``wanted`` the ledger does not record, in order, under the advisory lock."""
    applied_now: list[str] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        # CREATE SCHEMA IF NOT EXISTS needs CREATE on the database even when the schema exists, which
        # an owner given only its schema lacks (docs/security.md): look first.
        if table.schema and not conn.execute(_SCHEMA_EXISTS, (table.schema,)).fetchone():
            conn.execute(sql.SQL("CREATE SCHEMA IF NOT EXISTS {}").format(sql.Identifier(table.schema)))
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (table_name TEXT NOT NULL, version TEXT NOT NULL,"
                " applied_at TIMESTAMPTZ NOT NULL DEFAULT now(), PRIMARY KEY (table_name, version))"
            ).format(_ledger(table))
        )
        done = _recorded(conn, table)
        for m in wanted:
            if m.version in done:
                continue
            conn.execute(render(m, table, conn, value_type).encode("utf-8"))
            conn.execute(
                sql.SQL("INSERT INTO {} (table_name, version) VALUES (%s, %s)").format(_ledger(table)),
                (table.qualified, m.version),
            )
            applied_now.append(m.version)
    return applied_now


def migrate(conn: psycopg.Connection[tuple[object, ...]], table: TableName) -> list[str]:
    """Apply every migration not yet recorded for ``table``; return the versions applied now."""
    return _apply(conn, table, available())


def ensure(
    conn: psycopg.Connection[tuple[object, ...]], table: TableName, feature: Feature, value_type: str | None = None
) -> list[str]:
    """Apply the migrations ``feature`` needs unless the ledger already records them (then this is
    one catalog query and no DDL), so a feature works on a table ``reaper migrate`` never touched
    (goharvest's) while the schema changes only through the migrations and their ledger.
    ``value_type``: the dead letters' value type where there is no outbox table to take it from."""
    versions = FEATURES[feature]
    if set(versions) <= _recorded(conn, table):
        return []
    return _apply(conn, table, [m for m in available() if m.version in versions], value_type)


def applied(conn: psycopg.Connection[tuple[object, ...]], table: TableName) -> list[str]:
    """The versions applied to ``table``, in order (for ``reaper check``)."""
    return sorted(_recorded(conn, table))


def _try_lock(conn: psycopg.Connection[tuple[object, ...]]) -> bool:
    row = conn.execute("SELECT pg_try_advisory_lock(%s)", (_INDEX_LOCK_KEY,)).fetchone()
    return bool(row and row[0])


def ensure_shard_index(conn: psycopg.Connection[tuple[object, ...]], table: TableName, shards: int) -> bool:
    """Create the index a shard's mark query walks when there are ``shards`` shards (none for one);
    True if this call built it. ``conn`` must be in autocommit mode.

    Built ``CONCURRENTLY``, so inserts into a large outbox go on meanwhile, and outside the ledger:
    the index depends on the configured number of shards, not on the package's version. A build
    left invalid by an interrupted one is dropped and done again."""
    if shards <= 1:
        return False
    index = shard_index(table, shards)
    # Wait for another builder by polling, not in pg_advisory_lock(): a session blocked there holds
    # a snapshot, which CREATE INDEX CONCURRENTLY waits out, while it waits for the lock this
    # session holds: a deadlock when several reapers start at once (seen in the chaos test).
    while not _try_lock(conn):
        time.sleep(0.1)
    try:
        row = conn.execute(
            "SELECT i.indisvalid FROM pg_index i WHERE i.indexrelid = to_regclass(%s)", (index.quoted,)
        ).fetchone()
        if row is not None and row[0]:
            return False
        if row is not None:
            conn.execute(sql.SQL("DROP INDEX CONCURRENTLY IF EXISTS {}").format(index.ident))
        conn.execute(
            sql.SQL("CREATE INDEX CONCURRENTLY {} ON {} ({}, id)").format(
                sql.Identifier(index.name), table.ident, shard_expression(shards)
            )
        )
        return True
    finally:
        conn.execute("SELECT pg_advisory_unlock(%s)", (_INDEX_LOCK_KEY,))

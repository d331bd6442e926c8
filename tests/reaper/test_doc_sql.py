"""Every fenced ``sql`` block in the README and docs/ runs against the real PostgreSQL, in doc order, on one
connection, in a fresh schema whose outbox ``reaper migrate`` made for the log source (outbox, fence,
dead letters, the Spark sink's tables, publication and slot). Written for ``outboxTable: public.outbox``
(or a ``shop`` schema), a block runs with the test's schema in their place, the outbox's schema first
on the search path; a psql variable (``:'topic'``) is given a value, and a statement with ``$n``
parameters runs with ``'{}'`` for each (a valid text and an empty text array: the docs' templates take
only those). A block that cannot run on its own says so in its first line, ``-- not run: <why>``, which
the reader sees too; keep those rare."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from harvester.daemon.cli import main
from tests.reaper.test_doc_snippets import DOCS
from tests.support.paths import ROOT
from tests.support.services import Services

BLOCK = re.compile(r"^```sql\n(.*?)^```", re.DOTALL | re.MULTILINE)
NOT_RUN = re.compile(r"-- not run: \S")
NOT_RUN_AT_MOST = 2


def blocks() -> list[tuple[str, bool, str]]:
    """(``file:line``, whether it runs, text) of every ``sql`` block, in doc order."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in BLOCK.finditer(text):
            where = f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}"
            out.append((where, not NOT_RUN.match(m.group(1)), m.group(1)))
    return out


@pytest.mark.unit
def test_blocks_not_run_are_rare() -> None:
    assert len(blocks()) >= 9
    assert sum(not runs for _, runs, _ in blocks()) <= NOT_RUN_AT_MOST


def in_schema(text: str, schema: str) -> str:
    """The block for the test's schema: ``public.``/``shop.`` names and the log source's default slot."""
    text = re.sub(r"\b(public|shop)\.", f"{schema}.", text)
    return text.replace("harvester_public_", f"harvester_{schema}_")


@pytest.fixture
def migrated(
    services: Services, pg: psycopg.Connection[tuple[object, ...]], schema: str, tmp_path: Path
) -> Iterator[str]:
    """``reaper migrate`` of ``<schema>.outbox`` with ``source: log``; the slot is dropped afterwards if a
    failed block left it (a slot keeps the server's log)."""
    config = tmp_path / "reaper.yaml"
    config.write_text(f"harvest:\n  dataSource: {services.pg_dsn}\n  outboxTable: {schema}.outbox\n  source: log\n")
    assert main(["migrate", "-f", str(config)]) == 0
    yield schema
    slot = f"harvester_{schema}_outbox"
    pg.execute("SELECT pg_drop_replication_slot(slot_name) FROM pg_replication_slots WHERE slot_name = %s", (slot,))
    pg.execute(sql.SQL("DROP PUBLICATION IF EXISTS {}").format(sql.Identifier(slot)))


@pytest.mark.integration
def test_every_sql_block_runs(pg: psycopg.Connection[tuple[object, ...]], migrated: str) -> None:
    schema = migrated
    pg.execute(sql.SQL("SET search_path TO {}, public").format(sql.Identifier(schema)))
    # commitSql's view (docs/spark.md), as the Spark sink's commit shows it, one staged row.
    pg.execute(
        "CREATE TEMP VIEW outbox_batch AS SELECT 'totals'::text AS topic, 'c-1'::text AS key,"
        " '{\"total\": 7}'::text AS value, '{}'::text[] AS header_keys, '{}'::text[] AS header_values,"
        " NULL::numeric AS sort_number, NULL::text AS sort_text, 1::bigint AS seq, now() AS create_time"
    )
    ran, failed = 0, []
    for where, runs, text in blocks():
        if not runs:
            continue
        statement = in_schema(re.sub(r":'(\w+)'", r"'doc-\1'", text), schema)
        template = not re.search(r"^PREPARE\b", statement, re.MULTILINE)  # a PREPARE's $n are its own
        parameters = ["{}"] * len(set(re.findall(r"\$(\d+)", statement))) if template else []
        try:
            if parameters:
                psycopg.RawCursor(pg).execute(statement, parameters)
            else:
                pg.execute(statement)  # no parameters: the simple protocol, several statements as psql sends them
        except psycopg.Error as exc:
            failed.append(f"{where}: {exc}".splitlines()[0])
            if pg.info.transaction_status == psycopg.pq.TransactionStatus.INERROR:
                pg.execute("ROLLBACK")  # a block's own BEGIN failed midway
        ran += 1
    assert not failed
    assert ran >= 9

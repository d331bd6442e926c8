"""Tables that hold copies of outbox rows keep up with the outbox's column types.

The dead-letter table takes the outbox's ``kafka_value`` type when it is created, and the Spark
sink's staging table holds text and bytes. An outbox widened afterwards (``VARCHAR(10000)`` to
``TEXT``, say) leaves a dead-letter table narrower than it: the first dead letter too long for it
fails on every try (SQLSTATE 22001) and stalls the harvester. ``reaper check`` reports such
columns (:func:`narrower`), ``reaper migrate`` widens them (:func:`widen`). Widening text to longer
text is a catalog change in PostgreSQL, without a table rewrite; any other difference (text against
``BYTEA``, say) is reported and left for a person to convert.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import LOCK_KEY, dead_letter_table

_COLUMNS = """
SELECT a.attname, t.typname, a.atttypmod, format_type(a.atttypid, a.atttypmod)
FROM pg_attribute a JOIN pg_type t ON t.oid = a.atttypid
WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped
"""

_TEXTS = frozenset({"varchar", "bpchar", "text"})
_TEXT_ARRAYS = frozenset({"_varchar", "_bpchar", "_text"})


@dataclass(frozen=True, slots=True)
class _Type:
    typname: str
    typmod: int  # varchar(n): n + 4; -1: unbounded
    spelled: str  # as format_type spells it

    def holds(self, other: _Type) -> bool:
        """Whether every value of ``other`` fits in this type unchanged."""
        if self.spelled == other.spelled:
            return True
        if (self.typname, other.typname) in (("text", "varchar"), ("_text", "_varchar")):
            return True
        same = self.typname == other.typname and self.typname in ("varchar", "_varchar")
        return same and (self.typmod == -1 or (other.typmod != -1 and self.typmod >= other.typmod))

    def widenable_to(self, other: _Type) -> bool:
        """Whether an ``ALTER COLUMN ... TYPE other`` keeps every value: text to text, arrays likewise."""
        return {self.typname, other.typname} <= _TEXTS or {self.typname, other.typname} <= _TEXT_ARRAYS


_TEXT_TYPE = _Type("text", -1, "text")
_TEXT_ARRAY = _Type("_text", -1, "text[]")
_BYTES = _Type("bytea", -1, "bytea")


@dataclass(frozen=True, slots=True)
class Narrower:
    """A column of a table derived from the outbox that cannot hold every value the outbox can."""

    table: TableName
    column: str
    current: str
    wanted: str
    widenable: bool  # text to longer text: ``reaper migrate`` changes it

    def __str__(self) -> str:
        where = f"{self.table}.{self.column} is {self.current}"
        if self.widenable:
            return f"{where}, narrower than the outbox's {self.wanted}: 'reaper migrate' widens it to {self.wanted}"
        return (
            f"{where}, which cannot hold the outbox's {self.wanted}: convert it by hand "
            "('reaper migrate' changes only text to longer text)"
        )


def _columns(conn: psycopg.Connection[Any], table: TableName) -> dict[str, _Type]:
    rows = conn.execute(_COLUMNS, (table.quoted,)).fetchall()
    return {str(r[0]): _Type(str(r[1]), int(r[2]), str(r[3])) for r in rows}


@dataclass(frozen=True, slots=True)
class Derived:
    """A table holding copies of outbox rows, and its columns narrower than the outbox's (None: the
    table does not exist yet)."""

    label: str
    table: TableName
    narrower: list[Narrower] | None


def narrower(conn: psycopg.Connection[Any], table: TableName) -> list[Derived]:
    """The dead-letter and Spark staging tables of ``table``, with their columns narrower than the outbox's."""
    outbox = _columns(conn, table)
    value = outbox.get("kafka_value", _TEXT_TYPE)
    wanted = {
        # Per table, each column's type it must be able to hold.
        ("dead-letter table", dead_letter_table(table)): {
            "kafka_topic": outbox.get("kafka_topic", _TEXT_TYPE),
            "kafka_key": outbox.get("kafka_key", _TEXT_TYPE),
            "kafka_value": value,
            "kafka_header_keys": _TEXT_ARRAY,
            "kafka_header_values": _TEXT_ARRAY,
        },
        ("spark staging table", table.derived("spark_staging")): {
            "kafka_topic": _TEXT_TYPE,
            "kafka_key": _TEXT_TYPE,
            "value_text": _TEXT_TYPE,
            "value_bytes": _BYTES,
            "header_keys": _TEXT_ARRAY,
            "header_values": _TEXT_ARRAY,
        },
    }
    found: list[Derived] = []
    for (label, derived), columns in wanted.items():
        have = _columns(conn, derived)
        narrow = [
            Narrower(derived, name, have[name].spelled, want.spelled, have[name].widenable_to(want))
            for name, want in columns.items()
            if name in have and not have[name].holds(want)
        ]
        found.append(Derived(label, derived, narrow if have else None))
    return found


def widen(conn: psycopg.Connection[Any], table: TableName) -> tuple[list[Narrower], list[Narrower]]:
    """Widen the derived tables' narrower text columns to the outbox's types, in one transaction;
    return the columns widened and those left (a different kind of type)."""
    widened: list[Narrower] = []
    left: list[Narrower] = []
    with conn.transaction():
        conn.execute("SELECT pg_advisory_xact_lock(%s)", (LOCK_KEY,))
        for derived in narrower(conn, table):
            for column in derived.narrower or []:
                if not column.widenable:
                    left.append(column)
                    continue
                conn.execute(
                    sql.SQL("ALTER TABLE {} ALTER COLUMN {} TYPE {}").format(
                        column.table.ident, sql.Identifier(column.column), sql.SQL(column.wanted)
                    )
                )
                widened.append(column)
    return widened, left

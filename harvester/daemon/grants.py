"""``reaper grants``: the SQL that gives the role ``reaper run`` connects as exactly what it needs on
the configured outbox, for its source and delivery mode, and nothing more ([security.md](../../docs/security.md)).

The schema's owner (the role that runs ``reaper migrate``) creates every table, the publication and
the slot; the runtime role only reads, deletes and updates rows under the fence, and writes dead
letters. What each statement is for is said beside it, so that a reviewer can check the list
against the code (``harvester/postgres/table/statements.py``, ``fencing.py``, ``migrations.ensure``).
``--spark-sink`` prints instead the grants of an application's role that writes into the outbox
through Spark's ``format("outbox")`` (``harvester/spark/store.py``).
"""

from __future__ import annotations

import re
from collections.abc import Iterable

from harvester.config import HarvesterConfig
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table, fence_table
from harvester.postgres.schema.privileges import Need, spark_sink_needs, spark_sink_serials

_ROLE = re.compile(r"^[a-z_][a-z0-9_]{0,62}$")


def role_error(role: str) -> str | None:
    """Why ``role`` is refused (None: accepted): an unquoted lower-case name, so the SQL needs no quoting."""
    if _ROLE.match(role):
        return None
    return f"role {role!r}: 1-63 lower-case letters, digits or underscores, not starting with a digit"


def needs(harvest: HarvesterConfig) -> list[Need]:
    """What ``harvest``'s source and delivery mode need on its tables (``reaper check`` checks them)."""
    table = harvest.table
    found = [
        Need(
            TableName(table.schema, "harvester_migrations"),
            ("SELECT",),
            "the migrations' ledger: at start, whether the fence and dead letters are in place",
        ),
        Need(
            fence_table(table),
            ("SELECT", "INSERT", "UPDATE"),
            "the fence: each term bumps its epoch (INSERT ... ON CONFLICT DO UPDATE), every change reads it;"
            " exactly-once keeps its checkpoint position there, the log source how far records are done",
        ),
        Need(
            dead_letter_table(table),
            ("SELECT", "INSERT"),
            "dead letters: a record given up moves there in the statement that deletes it",
        ),
    ]
    if harvest.log_messages:
        return found
    rights: tuple[str, ...]
    if harvest.layout == "debezium" and not harvest.log_retention:
        what, rights = "Debezium's layout, read from the slot; the reaper deletes none of its rows", ("SELECT",)
    elif harvest.layout == "debezium":
        what = "Debezium's layout, read from the slot; delivered rows that stay deleted in bulk"
        rights = ("SELECT", "DELETE")
    elif harvest.source == "log":
        what, rights = "read the rows the slot names, delete them once delivered", ("SELECT", "DELETE")
    else:
        what, rights = "mark (read), purge (delete), count failed attempts (update)", ("SELECT", "UPDATE", "DELETE")
    return [*found, Need(table, rights, f"the outbox: {what}")]


def _serial(table: TableName, column: str, role: str) -> list[str]:
    """USAGE on the sequence behind ``table.column``, named by PostgreSQL (it truncates long names its own way)."""
    target = table.quoted.replace("'", "''")
    return [
        "DO $$ DECLARE s text := pg_get_serial_sequence('" + target + "', '" + column + "'); BEGIN",
        f"  IF s IS NOT NULL THEN EXECUTE format('GRANT USAGE ON SEQUENCE %s TO {role}', s); END IF;",
        "END $$;",
    ]


def _create(role: str) -> list[str]:
    return [
        "DO $$ BEGIN",
        f"  IF NOT EXISTS (SELECT FROM pg_roles WHERE rolname = '{role}') THEN CREATE ROLE {role} LOGIN; END IF;",
        "END $$;",
    ]


def _script(head: list[str], table: TableName, role: str, wanted: Iterable[Need]) -> list[str]:
    """``head``, then the role made, its schema's usage and a GRANT for each of ``wanted``."""
    lines = [*head, *_create(role), f'GRANT USAGE ON SCHEMA "{table.schema or "public"}" TO {role};']
    for need in wanted:
        lines += [f"-- {need.why}", f"GRANT {', '.join(need.privileges)} ON {need.table.quoted} TO {role};"]
    return lines


def spark_sink_grants(table: TableName, role: str) -> str:
    """The SQL script for ``role``, a writer of ``table`` through the Spark sink (not the reaper)."""
    head = [
        f"-- grants for a Spark format('outbox') writer of {table.qualified}, role {role} (not the reaper's).",
        "-- Apply as the schema's owner (or a superuser) after 'reaper migrate' ran as the owner (it creates",
        f"-- the sink's tables); give the role its password apart from this script (\\password {role}).",
    ]
    lines = _script(head, table, role, spark_sink_needs(table))
    lines += ["-- the ids of the outbox and of the task attempts"]
    for serial, column in spark_sink_serials(table):
        lines += _serial(serial, column, role)
    return "\n".join(lines) + "\n"


def grants(harvest: HarvesterConfig, role: str) -> str:
    """The SQL script for ``role`` and ``harvest``'s outbox, source and delivery mode."""
    table = harvest.table
    mode = f"source {harvest.source}, delivery {harvest.delivery}" + (", table-less" if harvest.log_messages else "")
    head = [
        f"-- reaper grants for outbox {table.qualified} ({mode}), runtime role {role}.",
        "-- Apply as the schema's owner (or a superuser) after 'reaper migrate' ran as the owner; give the",
        f"-- role its password apart from this script (\\password {role}).",
    ]
    lines = _script(head, table, role, needs(harvest))
    if harvest.source == "log":
        lines += [
            "-- the log source streams the slot the owner created (a superuser grants this attribute)",
            f"ALTER ROLE {role} REPLICATION;",
        ]
    return "\n".join(lines) + "\n"

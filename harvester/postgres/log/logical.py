"""What the log source needs from the server: ``wal_level = logical``, a role that may read slots
(REPLICATION or superuser), a publication of the outbox's inserts and a ``pgoutput`` slot.
``reaper migrate`` creates the last two (:func:`create`); ``reaper check`` and the harvester's start
report what is missing with the fix (:func:`missing`).

The log source needs PostgreSQL 14+ (pgoutput's ``binary`` option; a table-less outbox its
``messages`` option too) and published columns of types it reads (:mod:`.records`). A
table-less outbox (``LogSetup.prefix``) publishes no table; pgoutput still wants an existing
publication to name, so it gets an empty one (which also keeps every table's changes out of the
stream).

On PostgreSQL 17+ the slot is a failover slot: a standby that synchronizes slots keeps a copy, so
that after its promotion the log source goes on from it (:func:`failover`, docs/log-source.md#failover)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import psycopg
from psycopg import sql

from harvester.postgres.log.records import PUBLISHED, READABLE_TYPES, readable
from harvester.postgres.schema.identifiers import TableName


@dataclass(frozen=True, slots=True)
class LogSetup:
    """The names the log source reads through."""

    table: TableName
    slot: str
    publication: str
    prefix: str | None = None  # the table-less outbox's message prefix (None: the table's inserts)
    # A table-less outbox runs though a failover would lose its records (logAcceptLossOnFailover).
    accept_loss: bool = False
    # Another layout's table (Debezium's): every column is published (its reader picks those it
    # names, an optional one too); else the kafka_* ones.
    every_column: bool = False


def missing(conn: psycopg.Connection[Any], setup: LogSetup) -> list[str]:
    """What keeps the log source from reading ``setup``, each with its fix; empty when nothing."""
    problems: list[str] = []
    row = conn.execute(
        "SELECT current_setting('wal_level'), r.rolreplication OR r.rolsuper, current_user"
        " FROM pg_roles r WHERE r.rolname = current_user"
    ).fetchone()
    level, may_replicate, user = row if row else ("?", False, "?")
    if level != "logical":
        problems.append(
            f"wal_level is {level}, the log source needs logical: ALTER SYSTEM SET wal_level = logical, then restart"
            " PostgreSQL (managed services: their logical replication setting)"
        )
    if not may_replicate:
        problems.append(f"role {user} may not read replication slots: ALTER ROLE {user} REPLICATION")
    if conn.info.server_version < 140000:
        problems.append("the log source needs PostgreSQL 14 or later (pgoutput's binary and messages options)")
    if setup.prefix is not None:
        return problems + _messages_missing(conn, setup)
    if not setup.every_column:  # another layout's types are checked as the stream names them
        problems += _unreadable(conn, setup.table)
    row = conn.execute(
        "SELECT p.pubinsert, EXISTS (SELECT FROM pg_publication_rel r WHERE r.prpubid = p.oid"
        " AND r.prrelid = to_regclass(%s)) OR p.puballtables FROM pg_publication p WHERE p.pubname = %s",
        (setup.table.quoted, setup.publication),
    ).fetchone()
    if row is None:
        problems.append(f"publication {setup.publication} does not exist: run 'reaper migrate'")
    elif not (row[0] and row[1]):
        problems.append(
            f"publication {setup.publication} does not publish the inserts of {setup.table}: "
            f"ALTER PUBLICATION {setup.publication} ADD TABLE {setup.table.quoted}, SET (publish = 'insert')"
        )
    return problems + _slot_missing(conn, setup)


def _unreadable(conn: psycopg.Connection[Any], table: TableName) -> list[str]:
    """The published columns of ``table`` whose type the log source cannot read, with the fix."""
    rows = conn.execute(
        "SELECT attname, atttypid, format_type(atttypid, atttypmod) FROM pg_attribute"
        " WHERE attrelid = to_regclass(%s) AND attname = ANY(%s) AND attnum > 0 AND NOT attisdropped",
        (table.quoted, list(PUBLISHED)),
    ).fetchall()
    return [
        f"the log source cannot read {name} of type {typ}: it reads {READABLE_TYPES} (ALTER TABLE ... ALTER COLUMN)"
        for name, oid, typ in rows
        if not readable(name, int(oid))
    ]


def _messages_missing(conn: psycopg.Connection[Any], setup: LogSetup) -> list[str]:
    problems: list[str] = []
    row = conn.execute("SELECT FROM pg_publication WHERE pubname = %s", (setup.publication,)).fetchone()
    if row is None:
        problems.append(f"publication {setup.publication} (an empty one) does not exist: run 'reaper migrate'")
    return problems + _slot_missing(conn, setup)


def _slot_missing(conn: psycopg.Connection[Any], setup: LogSetup) -> list[str]:
    problems: list[str] = []
    row = conn.execute(
        "SELECT plugin, database = current_database() FROM pg_replication_slots WHERE slot_name = %s", (setup.slot,)
    ).fetchone()
    if row is None:
        problems.append(f"replication slot {setup.slot} does not exist: run 'reaper migrate'")
    elif row[0] != "pgoutput" or not row[1]:
        problems.append(
            f"replication slot {setup.slot} is not a pgoutput slot of this database: choose another logSlot"
        )
    return problems


def create(conn: psycopg.Connection[Any], setup: LogSetup) -> list[str]:
    """Create the publication and the slot if absent (autocommit connection); what was created."""
    created: list[str] = []
    exists = conn.execute("SELECT FROM pg_publication WHERE pubname = %s", (setup.publication,)).fetchone()
    if exists is None and setup.prefix is not None:
        conn.execute(sql.SQL("CREATE PUBLICATION {}").format(sql.Identifier(setup.publication)))
        created.append(f"publication {setup.publication} (empty: the outbox is table-less)")
    elif exists is None:
        # PostgreSQL 15+ publishes only the columns a record needs: less to decode and to send.
        columns: sql.Composable = sql.SQL("")
        if conn.info.server_version >= 150000 and not setup.every_column:
            columns = sql.SQL(" ({})").format(sql.SQL(", ").join(map(sql.Identifier, PUBLISHED)))
        conn.execute(
            sql.SQL("CREATE PUBLICATION {} FOR TABLE {}{} WITH (publish = 'insert')").format(
                sql.Identifier(setup.publication), setup.table.ident, columns
            )
        )
        created.append(f"publication {setup.publication}")
    exists = conn.execute("SELECT FROM pg_replication_slots WHERE slot_name = %s", (setup.slot,)).fetchone()
    if exists is None:
        # The slot starts at the current end of the log: rows already in the table before it are not
        # in the slot (docs/log-source.md: switching an outbox to the log source). PostgreSQL 17+: a
        # failover slot, which standbys with sync_replication_slots copy.
        failover = conn.info.server_version >= FAILOVER_SLOTS
        conn.execute(
            "SELECT pg_create_logical_replication_slot(%s, 'pgoutput'" + (", failover => true)" if failover else ")"),
            (setup.slot,),
        )
        created.append(f"replication slot {setup.slot}" + (" (failover)" if failover else ""))
    return created


FAILOVER_SLOTS = 170000
"""The first server version whose standbys synchronize logical slots."""


@dataclass(frozen=True, slots=True)
class Failover:
    """What the primary shows of its slot's fate in a failover. A standby's own settings cannot be
    read from it; a physical slot listed in ``synchronized_standby_slots`` that holds a
    ``catalog_xmin`` is the trace of a standby that keeps logical slots and sends feedback, as one
    synchronizing slots does (``sync_replication_slots``, ``hot_standby_feedback``)."""

    slot: str
    version: int
    failover: bool  # the slot exists and is a failover slot
    standby_slots: tuple[str, ...]  # synchronized_standby_slots
    syncing: tuple[str, ...]  # those of them whose standby keeps logical slots

    @property
    def protected(self) -> bool:
        """A standby keeps a copy of the slot, and the reader is never ahead of that standby."""
        return self.failover and bool(self.syncing)

    def problem(self) -> str | None:
        """Why a failover loses the slot (with the fix), or None when a standby synchronizes it."""
        if self.version < FAILOVER_SLOTS:
            return f"replication slot {self.slot} has no copy on a standby before PostgreSQL 17: a failover loses it"
        if not self.failover:
            return (
                f"replication slot {self.slot} is not a failover slot: ALTER_REPLICATION_SLOT {self.slot}"
                " (FAILOVER true) over a replication connection (psql 'dbname=<db> replication=database')"
            )
        if not self.standby_slots:
            return (
                "synchronized_standby_slots is empty: no standby is known to synchronize slots"
                " (ALTER SYSTEM SET synchronized_standby_slots = '<the standby's physical slot>')"
            )
        if not self.syncing:
            return (
                f"no standby on {', '.join(self.standby_slots)} (synchronized_standby_slots) synchronizes slots:"
                " it needs primary_slot_name, hot_standby_feedback = on, sync_replication_slots = on and a dbname"
                " in primary_conninfo"
            )
        return None

    def describe(self) -> str:
        """One line for ``reaper check``."""
        problem = self.problem()
        if problem is not None:
            return f"not protected: {problem}"
        return (
            f"failover slot, synchronized by the standby on {', '.join(self.syncing)} (synchronized_standby_slots;"
            " whether its copy is ready, the standby's pg_replication_slots says: synced, not temporary)"
        )


def failover(conn: psycopg.Connection[Any], slot: str) -> Failover:
    """What the primary shows of ``slot``'s protection against a failover."""
    version = conn.info.server_version
    if version < FAILOVER_SLOTS:
        return Failover(slot, version, False, (), ())
    row = conn.execute("SELECT failover FROM pg_replication_slots WHERE slot_name = %s", (slot,)).fetchone()
    listed = conn.execute("SELECT current_setting('synchronized_standby_slots')").fetchone()
    standby = tuple(s.strip().strip('"') for s in str(listed[0] if listed else "").split(",") if s.strip())
    rows = conn.execute(
        "SELECT slot_name FROM pg_replication_slots WHERE slot_type = 'physical' AND slot_name = ANY(%s)"
        " AND catalog_xmin IS NOT NULL AND invalidation_reason IS NULL",
        (list(standby),),
    ).fetchall()
    return Failover(slot, version, bool(row and row[0]), standby, tuple(str(r[0]) for r in rows))


def failover_risk(conn: psycopg.Connection[Any], setup: LogSetup) -> str | None:
    """A table-less outbox's refusal to run where a failover would lose records (its records exist
    only in the log, from the slot's position on), or None."""
    if setup.prefix is None or setup.accept_loss:
        return None
    problem = failover(conn, setup.slot).problem()
    if problem is None:
        return None
    return (
        f"a failover would lose the table-less outbox's records not yet delivered ({problem});"
        " set harvest.logAcceptLossOnFailover: true to run anyway"
    )


def takeover(fence: TableName, server_version: int) -> sql.Composed:
    """Under the current epoch only (parameters: the fence row's outbox and shard, the epoch, the
    slot): where the slot stands, and its other reader (a paused old leader's walsender) terminated;
    PostgreSQL 14+ waits until it is gone, so no confirmation it had not yet processed can move the
    slot afterwards. The third column says whether the server invalidated the slot (``wal_status``
    is ``lost`` for every cause on 14+: WAL past ``max_slot_wal_keep_size``, a conflict on a standby)."""
    wait = ", 5000" if server_version >= 140000 else ""
    return sql.SQL(
        "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND shard = %s AND epoch = %s)"
        " SELECT s.confirmed_flush_lsn::text, pg_terminate_backend(s.active_pid" + wait + "),"
        " coalesce(s.wal_status = 'lost', false) FROM fence, pg_replication_slots s WHERE s.slot_name = %s"
    ).format(f=fence.ident)


def recreate(conn: psycopg.Connection[Any], setup: LogSetup) -> bool:
    """Drop ``setup``'s slot if the server invalidated it, then create it if absent (autocommit
    connection): the recovery of a lost slot (recovery.py). Whether it created the slot."""
    row = conn.execute(
        "SELECT active_pid FROM pg_replication_slots WHERE slot_name = %s AND wal_status = 'lost'", (setup.slot,)
    ).fetchone()
    if row is not None:
        if row[0] is not None:
            conn.execute("SELECT pg_terminate_backend(%s, 5000)", (row[0],))
        conn.execute("SELECT pg_drop_replication_slot(%s)", (setup.slot,))
    return any(made.startswith("replication slot") for made in create(conn, setup))


def slot_state(conn: psycopg.Connection[Any], slot: str) -> tuple[int, int, bool] | None:
    """(bytes of WAL not yet consumed by the slot, bytes of WAL the slot retains, whether a reader is
    attached), or None if the slot is absent."""
    row = conn.execute(
        "SELECT pg_wal_lsn_diff(pg_current_wal_lsn(), confirmed_flush_lsn),"
        " pg_wal_lsn_diff(pg_current_wal_lsn(), restart_lsn), active FROM pg_replication_slots WHERE slot_name = %s",
        (slot,),
    ).fetchone()
    return None if row is None else (int(row[0] or 0), int(row[1] or 0), bool(row[2]))

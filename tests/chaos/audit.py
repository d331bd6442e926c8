"""The audit of "no change past a fence": who changed what, and when each holder's term began.

Triggers record, with the connection's ``application_name`` (a harvester's is ``outbox-harvester
<name>``, one per process) and the server's clock, every term that starts (a fence row inserted or
given a new epoch), every other update of a fence row (the stored log position, the checkpoint
position), every outbox row updated or deleted (a failure counted, a purge, a retention sweep, a
row moved to the dead letters) and every dead letter inserted. :class:`SlotWatch` samples the log
source's slot for its confirmations. :func:`past_fence` then finds every change made by a process
while another one held the term of that change's shard.

Why the server's clock orders them: a term starts with an UPDATE of its fence row, which waits for
every statement of the old epoch that share-locked the row (the guard of every fenced statement)
to commit, and a statement of the old epoch that comes later finds the new epoch and changes
nothing. So a fenced change of the old holder is audited before the new term's row, and one
audited after it is a change the fence let through.
"""

from __future__ import annotations

import bisect
import itertools
import threading
from collections import defaultdict
from collections.abc import Sequence
from dataclasses import dataclass
from datetime import datetime

import psycopg
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table, fence_table
from harvester.postgres.schema.sharding import shard_expression

TERM = "term"


@dataclass(frozen=True)
class Change:
    """A term that started (``kind`` :data:`TERM`) or a change audited during ``[since, at]``
    (one moment, ``since`` None, but for a slot confirmation, seen between two samples)."""

    at: datetime
    kind: str  # TERM, "DELETE", "UPDATE", "dead letter", "fence row" or "slot"
    app: str
    shard: int
    detail: str = ""
    since: datetime | None = None

    def __str__(self) -> str:
        when = f"{self.at:%H:%M:%S.%f}" if self.since is None else f"{self.since:%H:%M:%S.%f}..{self.at:%H:%M:%S.%f}"
        return f"{self.kind} {self.detail} by {self.app!r} on shard {self.shard} at {when}".replace("  ", " ")


def past_fence(history: Sequence[Change]) -> list[str]:
    """Every change of ``history`` made by a process that held no term of its shard then (none
    started yet, or another process's started since its own): a change past a fence."""
    terms: dict[int, list[tuple[datetime, str]]] = defaultdict(list)
    for c in sorted((c for c in history if c.kind == TERM), key=lambda c: c.at):
        terms[c.shard].append((c.at, c.app))
    out = []
    for c in sorted((c for c in history if c.kind != TERM), key=lambda c: c.at):
        starts = terms[c.shard]
        first = bisect.bisect_right(starts, c.since or c.at, key=lambda t: t[0])
        last = bisect.bisect_right(starts, c.at, key=lambda t: t[0])
        # The holders during [since, at]: the one whose term ran at its start, and any that began in it.
        holders = {app for _, app in starts[max(0, first - 1) : last]}
        if c.app not in holders:
            now = starts[last - 1][1] if last else "nobody"
            out.append(f"{c} while {now!r} held the term")
    return out


def install(dsn: str, table: TableName, *, shards: int = 1, outbox: bool = True) -> TableName:
    """Create the audit table beside ``table`` and the triggers that fill it: on the fence table
    (which must exist), the dead-letter table if it exists, and, with ``outbox``, the outbox table.
    ``shards``: the number the harvesters use, to tell a row's shard from its key."""
    audit = TableName(table.schema, "fence_audit")
    shard = shard_expression(shards)

    def function(name: str, body: str) -> sql.Composed:
        return sql.SQL(
            "CREATE FUNCTION {f}() RETURNS trigger LANGUAGE plpgsql AS $$ BEGIN " + body + " RETURN NULL; END $$;"
        ).format(f=TableName(table.schema, name).ident, a=audit.ident, shard=shard, q=sql.Literal(table.qualified))

    app = "current_setting('application_name')"
    with psycopg.connect(dsn, autocommit=True) as conn:
        conn.execute(
            sql.SQL(
                "CREATE TABLE {} (at TIMESTAMPTZ NOT NULL DEFAULT clock_timestamp(), kind TEXT NOT NULL,"
                " app TEXT NOT NULL, shard INT NOT NULL, detail TEXT NOT NULL, value TEXT)"
            ).format(audit.ident)
        )
        conn.execute(
            function(
                "fence_audit_term",
                "IF NEW.outbox_table = {q} THEN INSERT INTO {a} (kind, app, shard, detail) VALUES ("
                " CASE WHEN TG_OP = 'INSERT' OR NEW.epoch <> OLD.epoch THEN 'term' ELSE 'fence row' END,"
                f" {app}, NEW.shard, 'epoch ' || NEW.epoch); END IF;",
            )
        )
        conn.execute(
            sql.SQL(
                "CREATE TRIGGER fence_audit AFTER INSERT OR UPDATE ON {} FOR EACH ROW EXECUTE FUNCTION {}()"
            ).format(fence_table(table).ident, TableName(table.schema, "fence_audit_term").ident)
        )
        # The shard of a row from its key, as the harvesters compute it.
        row_shard = "(SELECT {{shard}} FROM (SELECT {row}.kafka_key) AS x(kafka_key))"
        targets = [(dead_letter_table(table), "INSERT", "NEW", "'dead letter'", "fence_audit_dead")]
        if outbox:
            targets.append((table, "UPDATE OR DELETE", "OLD", "TG_OP", "fence_audit_row"))
        for target, ops, row, kind, name in targets:
            exists = conn.execute("SELECT to_regclass(%s)", (target.qualified,)).fetchone()
            if exists is None or exists[0] is None:
                continue
            conn.execute(
                function(
                    name,
                    f"INSERT INTO {{a}} (kind, app, shard, detail, value) VALUES ({kind}, {app},"
                    f" {row_shard.format(row=row)}, 'id ' || {row}.id, {row}.kafka_value::text);",
                )
            )
            conn.execute(
                sql.SQL("CREATE TRIGGER fence_audit AFTER " + ops + " ON {} FOR EACH ROW EXECUTE FUNCTION {}()").format(
                    target.ident, TableName(table.schema, name).ident
                )
            )
    return audit


def changes_of(dsn: str, audit: TableName, values: Sequence[str]) -> dict[str, list[str]]:
    """For each of ``values``, who deleted or dead-lettered its outbox row(s), and when: the
    evidence of a loss report."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT value, kind, detail, app, at FROM {} WHERE value = ANY(%s) ORDER BY at").format(
                audit.ident
            ),
            (list(values),),
        ).fetchall()
    out: dict[str, list[str]] = {v: [] for v in values}
    for value, kind, detail, app, at in rows:
        out[str(value)].append(f"{detail} {kind} by {app!r} at {at:%H:%M:%S.%f}")
    return out


def history(dsn: str, audit: TableName) -> list[Change]:
    """What the triggers recorded, in time order."""
    with psycopg.connect(dsn) as conn:
        rows = conn.execute(
            sql.SQL("SELECT at, kind, app, shard, detail FROM {} ORDER BY at").format(audit.ident)
        ).fetchall()
    return [Change(at, kind, app, shard, detail) for at, kind, app, shard, detail in rows]


class SlotWatch:
    """Samples a slot's confirmed position and the process of the WAL sender that holds it, every
    ``every`` seconds, from a thread (samples fail while the server restarts: none then).
    :meth:`confirmations` are the moves seen between two samples of the same WAL sender."""

    def __init__(self, dsn: str, slot: str, every: float = 0.2) -> None:
        self._dsn, self._slot, self._every = dsn, slot, every
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="chaos-slot-watch", daemon=True)
        self.samples: list[tuple[datetime, int, int | None, str | None]] = []  # (at, position, pid, app)

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(30)

    def _run(self) -> None:
        query = (
            "SELECT clock_timestamp(), pg_wal_lsn_diff(s.confirmed_flush_lsn, '0/0')::bigint, s.active_pid,"
            " a.application_name FROM pg_replication_slots s LEFT JOIN pg_stat_activity a ON a.pid = s.active_pid"
            " WHERE s.slot_name = %s"
        )
        conn: psycopg.Connection[tuple[object, ...]] | None = None
        while not self._stop.wait(self._every):
            try:
                if conn is None or conn.closed:
                    conn = psycopg.connect(
                        self._dsn, autocommit=True, connect_timeout=3, application_name="chaos-watch"
                    )
                row = conn.execute(query, (self._slot,)).fetchone()
            except psycopg.Error:
                if conn is not None:
                    conn.close()
                conn = None
                continue
            if row is not None:
                at, position, pid, app = row
                assert isinstance(at, datetime)
                pid_ = None if pid is None else int(str(pid))
                self.samples.append((at, int(str(position)), pid_, None if app is None else str(app)))
        if conn is not None:
            conn.close()

    def confirmations(self) -> list[Change]:
        """The slot's moves made by one WAL sender, each seen between two of its samples."""
        return confirmations(self.samples)


def confirmations(samples: Sequence[tuple[datetime, int, int | None, str | None]]) -> list[Change]:
    """The moves of a slot's confirmed position between two consecutive ``samples`` (at, position,
    WAL sender's pid, its application_name) of the same WAL sender: that sender confirmed it."""
    out = []
    for (since, before, pid, app), (at, after, pid2, _) in itertools.pairwise(samples):
        if pid is not None and pid == pid2 and app and after > before:
            out.append(Change(at, "slot", app, 0, f"confirmed {before}->{after}", since))
    return out

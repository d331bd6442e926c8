"""The outbox table in PostgreSQL (psycopg 3): mark, purge, reset, dead-letter, and wake-up on
NOTIFY, all under the epoch fence (see :mod:`harvester.postgres.table.statements`).

Marking writes nothing: the store remembers which ids it handed out under the current leader id
(:mod:`harvester.postgres.table.marks`) and the next mark reads the first rows not among them. A reset
just makes its ids eligible again.

:meth:`PostgresStore.prepare` reads the table's shape and builds the statements once, before any
other call; nothing else queries the catalog or changes the schema. Each method uses a connection
of its own thread's role (marking, purging, listening), so the mark loop and the purge/reset
pipeline never wait on each other's round trips. A broken connection is dropped and re-opened on
the next call; callers back off and retry, and since purge and reset are idempotent nothing is lost
by retrying.
"""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from harvester.core.identity import IdentityHeaders, Stamp
from harvester.core.protocols import FencedError, ShardCountError, StoreError
from harvester.core.records import Failure, MarkedRecord
from harvester.postgres.connections import Connections, error_text
from harvester.postgres.deadline import limit_statements
from harvester.postgres.schema import catalog, migrations
from harvester.postgres.schema.catalog import OutboxColumns, OutboxMissingError
from harvester.postgres.schema.fencing import Fence
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import notify_channel
from harvester.postgres.table.frontier import WRITERS, Frontier, ordered_ids
from harvester.postgres.table.marks import HandedOut
from harvester.postgres.table.rows import Pending
from harvester.postgres.table.rows import malformed as rows_malformed
from harvester.postgres.table.statements import (
    PLANNER_OPTIONS,
    Statements,
    dense_range,
    id_array,
    id_bitmap,
    whole_range,
)
from harvester.postgres.table.vacuum import Vacuumer

__all__ = ["FencedError", "OutboxMissingError", "PostgresStore", "ShardCountError", "StoreError"]


@dataclass(frozen=True, slots=True)
class _Prepared:
    """What :meth:`PostgresStore.prepare` learnt; assigned whole, so a failed prepare leaves none."""

    columns: OutboxColumns
    statements: Statements
    producer: bytes  # the identity headers' producer name
    frontier: bool  # whether marks skip what is behind the frontier (frontier.py)


class PostgresStore:
    """The store roles of :mod:`harvester.core.protocols` over one outbox table, or over shard
    ``shard`` of its ``shards`` (:mod:`harvester.postgres.schema.sharding`): then it marks only that
    shard's rows and runs under that shard's fence row. Its connections (:attr:`db`) and its side of
    the fence (:attr:`fence`) are parts of their own, which the log source's stores use too."""

    def __init__(
        self,
        dsn: str,
        table: TableName,
        *,
        application_name: str = "outbox-harvester",
        identity: IdentityHeaders | None = None,
        producer_name: str | None = None,
        hold_dead_letter_keys: bool = False,
        vacuum_every: int = 0,
        shard: int = 0,
        shards: int = 1,
        statement_timeout: float = 0.0,
        session_options: str = "",
        release_on_ack: bool | None = None,
    ) -> None:
        """``session_options``: server options of every session, after the planner's.
        ``release_on_ack`` (:attr:`harvester.core.protocols.Purger.release_on_ack`): a key's next
        record may go out at its previous one's acknowledgement, several in flight in order, since
        their purges commit in that order and a new term marks in id order what a crash left
        unpurged: a run of the key's latest records, in order; the default, but with
        ``hold_dead_letter_keys`` (a key held behind its dead letter must have sent nothing past
        it). Without it (goharvest's one record per key), after its purge: a crash repeats only a
        key's last record."""
        if not 0 <= shard < shards:
            raise ValueError(f"shard {shard} is not one of {shards} shards")
        self.table = table
        self.release_on_ack = not hold_dead_letter_keys if release_on_ack is None else release_on_ack
        # The statements are prepared once and run thousands of times, each with a custom plan and
        # without sorts (see PLANNER_OPTIONS), after the DSN's own options, if it has any.
        options = " ".join(filter(None, [PLANNER_OPTIONS, session_options]))
        self.db = Connections(
            dsn, application_name=application_name, options=options, statement_timeout=statement_timeout
        )
        self.fence = Fence(self.db, table, shard, shards)
        self._names = identity or IdentityHeaders()
        self._producer_name = producer_name
        self._hold = hold_dead_letter_keys
        connect = {"connect_timeout": 5, "application_name": application_name, "options": self.db.options}
        self._vacuum = Vacuumer(dsn, table, vacuum_every, connect)
        self._handed = HandedOut()
        self._frontier = Frontier(self._handed)
        self._prepared: _Prepared | None = None
        self._dead_letter_ready = hold_dead_letter_keys  # prepare() ensures it then
        self._listening: psycopg.Connection[Any] | None = None

    # ------------------------------------------------------------------ set-up

    @classmethod
    def open(cls, dsn: str, table: TableName, **options: Any) -> PostgresStore:
        """A prepared store: the constructor (``options`` as it takes them), then :meth:`prepare`."""
        store = cls(dsn, table, **options)
        try:
            store.prepare()
        except BaseException:
            store.close()
            raise
        return store

    def prepare(self) -> OutboxColumns:
        """Read the table's shape, apply the fence (and, holding dead-lettered keys, the dead-letter)
        migrations through the ledger if they are missing, check the number of shards against the
        recorded one (building the shards' index if it is missing), and build the statements.
        Idempotent.

        Raises :class:`OutboxMissingError` or :class:`StoreError` on a missing or unsupported table,
        :class:`StoreUnreachableError` on an unreachable database or a connection lost on the way (a
        restart), :class:`ShardCountError` when other reapers harvest the outbox with another number
        of shards."""
        if self._prepared is not None:
            return self._prepared.columns
        conn, started = self.db.conn(), time.monotonic()
        try:
            if self.db.server_limit:
                limit_statements(conn, 0)  # migrations and an index build may take their time
            columns = self._read_columns(conn)
            migrations.ensure(conn, self.table, "fence")
            if self._hold:
                migrations.ensure(conn, self.table, "dead_letter")
            self.fence.check_shards(conn)
            migrations.ensure_shard_index(conn, self.table, self.fence.shards)
            producer = self._producer_name
            if producer is None:
                row = conn.execute("SELECT system_identifier FROM pg_control_system()").fetchone()
                producer = f"{row[0] if row else 0}/{self.table.qualified}"
            frontier = not self._hold and ordered_ids(conn, self.table)
            if self.db.server_limit:
                limit_statements(conn, self.db.server_limit)
        except psycopg.OperationalError as exc:  # a lost connection (a restart): retried, as any start
            raise self.db.failed(conn, exc, started) from exc
        except psycopg.Error as exc:
            raise StoreError(f"preparing {self.table} failed: {error_text(exc)}") from exc
        statements = Statements.build(self.table, columns, hold_dead_letter_keys=self._hold, shards=self.fence.shards)
        self._prepared = _Prepared(columns, statements, producer.encode("utf-8"), frontier)
        return columns

    def _read_columns(self, conn: psycopg.Connection[Any]) -> OutboxColumns:
        """The outbox table's shape."""
        return catalog.read(conn, self.table)

    def sibling(self, shard: int) -> PostgresStore:
        """A store of another shard of the same outbox, sharing what :meth:`prepare` learnt (so it
        needs no catalog query) but no connection."""
        prepared = self._ready()
        store = PostgresStore(
            self.db.dsn,
            self.table,
            application_name=self.db.application_name,
            identity=self._names,
            producer_name=self._producer_name,
            hold_dead_letter_keys=self._hold,
            vacuum_every=self._vacuum.every,
            shard=shard,
            shards=self.fence.shards,
            statement_timeout=self.db.statement_timeout,
            release_on_ack=self.release_on_ack,
        )
        store._prepared = prepared
        return store

    @property
    def shard(self) -> int:
        """The shard this store harvests (0 when the outbox is not sharded)."""
        return self.fence.shard

    def _ready(self) -> _Prepared:
        prepared = self._prepared
        if prepared is None:
            raise RuntimeError("PostgresStore.prepare() must be called first")
        return prepared

    @property
    def tracks_attempts(self) -> bool:
        """Whether the table has the optional attempt columns (``reaper migrate`` adds them)."""
        return self._ready().columns.tracks_attempts

    # ------------------------------------------------------------------ fenced changes

    @property
    def epoch(self) -> int:
        """The epoch this store's statements run under (0 before :meth:`acquire`)."""
        return self.fence.epoch

    def acquire(self, leader_id: UUID) -> int:
        """Bump the fence epoch of this store's shard and run under the new epoch.

        Raises :class:`ShardCountError` when a shard's fence records another number of shards."""
        return self.fence.acquire(leader_id)

    def join(self, epoch: int) -> None:
        """Run under ``epoch``, a term another process of the same holder started, without bumping
        it: the Spark drain's sink dead-letters on the driver apart from the source that took the
        term. Its changes are refused once a newer term superseded that epoch."""
        self.fence.epoch = epoch

    def checkpoint_position(self) -> int:
        """Where exactly-once recovery starts reading the checkpoint topic."""
        return self.fence.checkpoint_position()

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Purge records of committed transactions and advance the checkpoint position, atomically."""
        params = (*self.fence.guard, id_array(ids), position, *self.fence.key)
        cur = self.db.execute(self._ready().statements.purge_checkpointed, params)
        if cur.rowcount == 0:
            raise FencedError(f"fenced: epoch {self.fence.epoch} superseded")
        self._handed.settled(ids)
        self._vacuum.purged(len(ids))

    # ------------------------------------------------------------------ mark, purge, reset

    def mark(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Mark up to ``limit`` records not yet marked by ``leader_id`` and return them sorted by id
        (a read: see the module's docstring).

        Each record carries the identity headers' stamp.
        """
        prepared = self._ready()
        kind = prepared.columns.limits.value_kind
        stamp = self.stamp()
        skip = self._frontier.before(leader_id, enabled=prepared.frontier)
        own = (self.fence.shard, self.fence.shard + 1) if self.fence.shards > 1 else ()
        params = (*self.fence.guard, *own, skip.start, id_array(skip.ids), limit)
        rows = self.db.run(prepared.statements.mark, params)
        if not rows:
            self.fence.check_epoch()  # fenced: the mark read nothing, so the frontier stays
        if self.fence.shards > 1:
            rows.sort(key=lambda r: r[0])  # a sharded mark leaves the order to us (see statements)
        ids = [r[0] for r in rows]
        self._handed.add(leader_id, ids)
        if prepared.frontier:
            self._frontier.after(leader_id, skip, ids, limit, self._writers)
        if not rows:
            return []
        out: list[MarkedRecord] = []
        for rid, created, topic, key, raw, hkeys, hvalues, attempts, first_failure in rows:
            value = raw.encode("utf-8") if raw is not None and kind != "bytes" else raw
            malformed = rows_malformed(key, hkeys, hvalues)
            headers: list[tuple[str, str | bytes | None]] = [
                (k, v.encode("utf-8") if v is not None else b"")
                for k, v in zip(hkeys or (), hvalues or (), strict=False)
            ]
            out.append(
                MarkedRecord(rid, created, topic, key or "", value, headers, attempts, first_failure, malformed, stamp)
            )
        return out

    def _writers(self) -> list[str]:
        """The transactions holding a writer's lock on the table now, but this store's own."""
        rows = self.db.run(WRITERS, (self.table.quoted, self.db.pids()))
        return list(rows[0][0])

    @property
    def frontier(self) -> int:
        """The first id marks look at (a bigint's least when they look from the start)."""
        return self._handed.start

    def stamp(self) -> Stamp:
        """The identity headers' stamp of the records handed out under the current epoch."""
        return Stamp.of(self._names, self.fence.epoch, self._ready().producer)

    def pending(self, skip: Sequence[int], limit: int) -> list[Pending]:
        """Up to ``limit`` records of this store's shard that are not in ``skip``, by id: what
        :meth:`mark` would hand out, without reading their values (for a caller that tracks what it
        handed out itself, as the Spark drain does in its offsets). Raises :class:`FencedError` when
        a newer epoch superseded ours."""
        own = (self.fence.shard, self.fence.shard + 1) if self.fence.shards > 1 else ()
        rows = self.db.run(self._ready().statements.pending, (*self.fence.guard, *own, id_array(skip), limit))
        if not rows:
            self.fence.check_epoch()
        return sorted(Pending(int(r[0]), r[1], r[2], int(r[3])) for r in rows)

    def head_id(self) -> int:
        """The outbox's highest id (0 when it is empty)."""
        rows = self.db.run(self._ready().statements.head, ())
        return int(rows[0][1]) if rows and rows[0][1] is not None else 0

    @property
    def producer(self) -> str:
        """The identity headers' producer name (see :mod:`harvester.core.identity`)."""
        return self._ready().producer.decode("utf-8")

    def durable(self, ids: Sequence[int]) -> list[int]:
        """All of ``ids``: a purge deleted them."""
        return list(ids)

    def purge(self, ids: Sequence[int]) -> None:
        """Delete delivered records in one statement (idempotent)."""
        if not ids:
            return
        statements, guard = self._ready().statements, self.fence.guard
        dense = dense_range(ids)
        if dense is not None and whole_range(ids, *dense):
            cur = self.db.execute(statements.purge_run, (*guard, *dense))
        elif dense is not None:
            low, high = dense
            cur = self.db.execute(statements.purge_range, (*guard, low, high, id_bitmap(ids, low, high), low))
        else:
            cur = self.db.execute(statements.purge, (*guard, id_array(ids)))
        if cur.rowcount < len(ids):
            # Fenced, a retry of a purge that already committed, or rows a trigger kept: as with a
            # mark written into the rows, they stay marked until the leader id is refreshed.
            self.fence.check_epoch()
        else:
            self._handed.settled(ids)
        self._vacuum.purged(len(ids))

    def reset(self, ids: Sequence[int]) -> None:
        """Make records whose delivery failed eligible for the next mark (no statement: a mark
        writes nothing to undo)."""
        self._handed.released(ids)

    def fail(self, failures: Sequence[Failure]) -> None:
        """Unmark permanently failed records, counting the attempt and keeping the error."""
        statement = self._ready().statements.fail
        if not failures:
            return
        if statement is None:
            self.reset([f.id for f in failures])
            return
        ids, errors = [f.id for f in failures], [f.error for f in failures]
        cur = self.db.execute(statement, (*self.fence.guard, ids, errors))
        if cur.rowcount < len(failures):
            self.fence.check_epoch()
        self._handed.released(ids)

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        """Move records into the dead-letter table in one statement; the first one applies the
        dead-letter migrations through the ledger if they are missing."""
        statement = self._ready().statements.dead_letter
        if not failures:
            return
        if not self._dead_letter_ready:
            conn = self.db.conn()
            try:
                migrations.ensure(conn, self.table, "dead_letter")
            except psycopg.Error as exc:
                why = error_text(exc)
                raise StoreError(f"creating the dead-letter table failed: {why}") from exc
            self._dead_letter_ready = True
        ids = [f.id for f in failures]
        try:
            cur = self.db.execute(
                statement,
                (
                    *self.fence.key,
                    self.fence.epoch,
                    ids,
                    self.fence.epoch,
                    leader_id,
                    ids,
                    [f.reason for f in failures],
                    [f.error for f in failures],
                    [f.attempts for f in failures],
                    [f.first_failure for f in failures],
                ),
            )
        except StoreError as exc:
            if isinstance(exc.__cause__, psycopg.errors.StringDataRightTruncation):  # 22001
                hint = "the dead-letter table is narrower than the outbox: 'reaper migrate' widens it"
                raise StoreError(f"{exc} ({hint})") from exc
            raise
        if cur.rowcount < len(failures):
            self.fence.check_epoch()
        self._handed.settled(ids)

    def head(self) -> tuple[int, float | None]:
        """A cheap backlog sample: (max id - min id + 1, age in seconds of the oldest record)."""
        lo, hi, age = self.db.run(self._ready().statements.head, ())[0]
        if lo is None:
            return 0, None
        return int(hi) - int(lo) + 1, float(age)

    # ------------------------------------------------------------------ idle wake-up

    def wait_for_insert(self, timeout: float) -> bool:
        """Block until the outbox trigger notifies (True) or ``timeout`` passes (False).

        Without the trigger (migration not applied) this simply sleeps; the caller's adaptive
        back-off keeps the polling rate low either way.
        """
        try:
            if self._listening is None or self._listening.closed or self._listening.broken:
                conn = self.db.connect()
                conn.execute(sql.SQL("LISTEN {}").format(sql.Identifier(notify_channel(self.table))))
                self._listening = conn
            for _ in self._listening.notifies(timeout=timeout, stop_after=1):
                return True
            return False
        except psycopg.Error as exc:
            if self._listening is not None:
                self.db.forget(self._listening)
                self._listening = None
            raise StoreError(f"listen failed: {error_text(exc)}") from exc

    def close(self) -> None:
        """Close every connection this store opened."""
        self._vacuum.close()
        self.db.close()

"""The epoch fence of a store's (outbox, shard): its row in the schema's fence table, which every
change of the store share-locks at the store's own epoch (the guard in
:mod:`harvester.postgres.table.statements`). A term starts by taking an epoch above every shard's of the
outbox, after checking the number of shards recorded with the fence; a statement that changed less
than it was given is checked against the current epoch; the exactly-once checkpoint position is kept
in the same row."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from harvester.core.protocols import FencedError, ShardCountError
from harvester.postgres.connections import Connections
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table
from harvester.postgres.schema.sharding import mismatch


@dataclass(frozen=True, slots=True)
class FenceStatements:
    """The statements on an outbox's fence rows; each takes (table, shard) as its first parameters,
    but ``recorded``, which takes the table only."""

    recorded: sql.Composed
    acquire: sql.Composed
    epoch: sql.Composed
    checkpoint_position: sql.Composed

    @classmethod
    def build(cls, table: TableName) -> FenceStatements:
        """The statements on ``table``'s fence rows."""
        f = fence_table(table).ident
        return cls(
            recorded=sql.SQL("SELECT DISTINCT shards FROM {} WHERE outbox_table = %s ORDER BY shards").format(f),
            # The epoch of a new term is one above every shard's of the outbox (under a lock per
            # outbox), so no two terms of an outbox share an epoch: a reader tells shards' terms
            # apart, and a key that moves to another shard (N changed) moves to higher epochs.
            acquire=sql.SQL(
                "INSERT INTO {f} AS x (outbox_table, shard, shards, epoch, leader_id)"
                " SELECT %s, %s, %s, 1 + coalesce(max(epoch), 0), %s FROM {f} WHERE outbox_table = %s"
                " ON CONFLICT (outbox_table, shard) DO UPDATE SET epoch = excluded.epoch,"
                " leader_id = excluded.leader_id, acquired_at = now() RETURNING epoch"
            ).format(f=f),
            epoch=sql.SQL("SELECT epoch FROM {} WHERE outbox_table = %s AND shard = %s").format(f),
            checkpoint_position=sql.SQL(
                "SELECT checkpoint_position FROM {} WHERE outbox_table = %s AND shard = %s"
            ).format(f),
        )


class Fence:
    """A store's side of the fence of shard ``shard`` of ``shards`` of ``table``, over the store's
    connections: the epoch its changes run under and the checks around it. A fenced statement takes
    :attr:`guard` as its first parameters."""

    def __init__(self, db: Connections, table: TableName, shard: int = 0, shards: int = 1) -> None:
        self._db = db
        self.table = table
        self.shard = shard
        self.shards = shards
        self.key = (table.qualified, shard)  # the fence row's key
        self._statements = FenceStatements.build(table)
        self.epoch = 0  # 0 before the first acquire

    @property
    def guard(self) -> tuple[str, int, int]:
        """The first parameters of every fenced statement: the fence row's key and the epoch."""
        return (*self.key, self.epoch)

    def acquire(self, leader_id: UUID) -> int:
        """Bump the fence epoch of this shard and run under the new epoch.

        Raises :class:`ShardCountError` when a shard's fence records another number of shards."""
        q = self.table.qualified
        conn = self._db.conn()
        with self._db.guarded(conn), conn.transaction():
            # One acquisition of the outbox at a time: each takes an epoch above all others.
            conn.execute("SELECT pg_advisory_xact_lock(hashtextextended(%s, 0))", (f"harvester_fence {q}",))
            self.check_shards(conn)
            row = conn.execute(self._statements.acquire, (q, self.shard, self.shards, leader_id, q)).fetchone()
        assert row is not None
        self.epoch = int(row[0])
        return self.epoch

    def check_shards(self, conn: psycopg.Connection[Any]) -> None:
        """Raise :class:`ShardCountError` when the outbox's fence records another number of shards."""
        other = sorted(
            {int(r[0]) for r in conn.execute(self._statements.recorded, (self.table.qualified,))} - {self.shards}
        )
        if other:
            raise ShardCountError(mismatch(self.table, self.shards, other[0]))

    def check_epoch(self) -> None:
        """Raise :class:`FencedError` if a newer epoch superseded ours (called on short results only)."""
        rows = self._db.run(self._statements.epoch, self.key)
        current = int(rows[0][0]) if rows else 0
        if current != self.epoch:
            raise FencedError(f"fenced: epoch {self.epoch} superseded by {current}")

    def checkpoint_position(self) -> int:
        """Where exactly-once recovery starts reading the checkpoint topic."""
        rows = self._db.run(self._statements.checkpoint_position, self.key)
        return int(rows[0][0]) if rows else 0

"""Writing outbox records inside an asyncio application's own transaction.

The counterpart of :class:`~harvester.client.stasher.Stasher` for psycopg's ``AsyncConnection``
and SQLAlchemy's ``AsyncSession``/``AsyncConnection``: the same validation, statements and trace
context (:class:`~harvester.client.stasher.BaseStasher`), awaited instead of blocking the loop.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from harvester.client.stasher import COPY_THRESHOLD, BaseStasher, copy_rows
from harvester.core.records import OutboxRecord
from harvester.postgres.schema import catalog

if TYPE_CHECKING:
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession


class AsyncStasher(BaseStasher):
    """Stashes records through an asynchronous psycopg connection or SQLAlchemy connection/session;
    never commits: the records are part of the caller's transaction."""

    async def stash(self, conn: psycopg.AsyncConnection[Any], records: OutboxRecord | Sequence[OutboxRecord]) -> int:
        """Insert records with a psycopg ``AsyncConnection``, in its current transaction; return
        the count. Many records go through one COPY, a few through one multi-row INSERT."""
        batch = self._batch(records)
        if not batch:
            return 0
        if self._limits is None:
            found = await (await conn.execute(catalog.CATALOG_SQL, (self.table.quoted,))).fetchall()
            self._limits = catalog.columns_from_rows(self.table, found).limits
        rows = self._rows(batch)
        if len(rows) < COPY_THRESHOLD:
            await conn.execute(*self._insert(rows))
            return len(rows)
        created = await (await conn.execute("SELECT now()")).fetchone()
        assert created is not None
        async with conn.cursor().copy(self._copy()) as cp:
            for row in copy_rows(created[0], rows):
                await cp.write_row(row)
        return len(rows)

    async def stash_sqlalchemy(
        self, target: SAAsyncConnection | AsyncSession, records: OutboxRecord | Sequence[OutboxRecord]
    ) -> int:
        """Insert records through a SQLAlchemy ``AsyncConnection`` or ``AsyncSession`` (its
        transaction)."""
        batch = self._batch(records)
        if not batch:
            return 0
        if self._limits is None:
            self._sa_limits((await target.execute(*self._sa_catalog())).all())
        rows = self._rows(batch)
        await target.execute(*self._sa_insert(rows))
        return len(rows)

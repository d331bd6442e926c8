"""Stashing into a table-less outbox: each record becomes a transactional logical decoding message,
``pg_logical_emit_message(true, <prefix>, <payload>)``, written in the application's transaction and
read by the log source once it commits (docs/log-source.md). No row is written, so there is nothing
to delete afterwards. The payload is :mod:`harvester.postgres.schema.message_format`'s; the prefix names
the outbox (the reaper's ``logPrefix``, default ``harvester:<schema>.<table>``).

The records of one call are written in one statement, in their order; a transaction's messages are
published in that order, after those of every transaction that committed before it.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import TYPE_CHECKING, Any

import psycopg

from harvester.client.stasher import BaseStasher
from harvester.core.records import ColumnLimits, OutboxRecord
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.message_format import default_prefix, encode

if TYPE_CHECKING:
    from sqlalchemy import TextClause
    from sqlalchemy.engine import Connection as SAConnection
    from sqlalchemy.ext.asyncio import AsyncConnection as SAAsyncConnection
    from sqlalchemy.ext.asyncio import AsyncSession
    from sqlalchemy.orm import Session

_EMIT = "SELECT pg_logical_emit_message(true, %s, p) FROM unnest(%s::bytea[]) AS p"
# A message holds whatever Kafka accepts: no column limits.
_ANY = ColumnLimits(key_max_chars=None, value_max_chars=None, value_kind="bytes")


class BaseMessageStasher(BaseStasher):
    """What the synchronous and asynchronous message stashers share: the prefix and the payloads."""

    def __init__(self, outbox: str | TableName = "outbox", prefix: str | None = None, *, trace_context: bool = True):
        super().__init__(outbox, _ANY, trace_context=trace_context)
        self.prefix = prefix or default_prefix(self.table)

    def _payloads(self, records: OutboxRecord | Sequence[OutboxRecord]) -> list[bytes]:
        payloads = []
        for r in self._batch(records):
            r.check_limits(_ANY)
            payloads.append(encode(r))
        return payloads

    def _sa_emit(self, payloads: list[bytes]) -> tuple[TextClause, dict[str, Any]]:
        from sqlalchemy import text

        statement = text(
            "SELECT pg_logical_emit_message(true, :prefix, p) FROM unnest(CAST(:payloads AS bytea[])) AS p"
        )
        return statement, {"prefix": self.prefix, "payloads": payloads}


class MessageStasher(BaseMessageStasher):
    """Stashes records into a table-less outbox through a psycopg connection or a SQLAlchemy
    connection/session; never commits: the records are part of the caller's transaction."""

    def stash(self, conn: psycopg.Connection[Any], records: OutboxRecord | Sequence[OutboxRecord]) -> int:
        """Write the records as messages in ``conn``'s current transaction; return the count."""
        payloads = self._payloads(records)
        if payloads:
            conn.execute(_EMIT, (self.prefix, payloads))
        return len(payloads)

    def stash_sqlalchemy(self, target: SAConnection | Session, records: OutboxRecord | Sequence[OutboxRecord]) -> int:
        """Write the records as messages through a SQLAlchemy ``Connection`` or ``Session``."""
        payloads = self._payloads(records)
        if payloads:
            target.execute(*self._sa_emit(payloads))
        return len(payloads)


class AsyncMessageStasher(BaseMessageStasher):
    """:class:`MessageStasher` for psycopg's ``AsyncConnection`` and SQLAlchemy's async ones."""

    async def stash(self, conn: psycopg.AsyncConnection[Any], records: OutboxRecord | Sequence[OutboxRecord]) -> int:
        """Write the records as messages in ``conn``'s current transaction; return the count."""
        payloads = self._payloads(records)
        if payloads:
            await conn.execute(_EMIT, (self.prefix, payloads))
        return len(payloads)

    async def stash_sqlalchemy(
        self, target: SAAsyncConnection | AsyncSession, records: OutboxRecord | Sequence[OutboxRecord]
    ) -> int:
        """Write the records as messages through a SQLAlchemy ``AsyncConnection`` or ``AsyncSession``."""
        payloads = self._payloads(records)
        if payloads:
            await target.execute(*self._sa_emit(payloads))
        return len(payloads)

"""The table-less outbox: records written as transactional logical decoding messages
(``pg_logical_emit_message(true, <prefix>, <payload>)``, :mod:`harvester.postgres.schema.message_format`)
and read by the log source from the slot, with no table and so nothing to delete.

Everything the log source does about the stream, terms, passes and confirmations stays
(:class:`~harvester.postgres.log.store.LogStore`); :class:`LogicalMessages` is its decoding, and
:func:`harvester.compose.log_store` composes it with a stored position in place of the delete
(:mod:`.position`) and records kept in memory for the dead letters (:class:`.rows.RowLess`).

A record's id is its message's LSN: unique, the same in every term (the slot sends the same WAL
records again), and what the identity headers, the checkpoints and the dead-letter table carry.
Its ``create_time`` is its transaction's commit time.
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import UTC, datetime, timedelta
from typing import Any

import psycopg

from harvester.core.records import ColumnLimits, MarkedRecord
from harvester.postgres.log import pgoutput
from harvester.postgres.log.decoding import decoded
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import ChangeDecoder, FastInserts
from harvester.postgres.log.transactions import Taken, Transaction, Transactions, messages
from harvester.postgres.schema import message_format
from harvester.postgres.schema.catalog import OutboxColumns
from harvester.postgres.schema.identifiers import TableName

EPOCH_2000 = datetime(2000, 1, 1, tzinfo=UTC)
# What a record may hold: whatever Kafka accepts (the stasher checks only the record itself).
BYTES_COLUMNS = OutboxColumns(
    ColumnLimits(key_max_chars=None, value_max_chars=None, value_kind="bytes"),
    key_type="text",
    value_type="bytea",
    header_defaults=True,
    tracks_attempts=False,
)


Stamp = tuple[Transaction | None, datetime]  # a transaction and its commit time as a datetime


def stamped(
    taken: Taken, decode: Callable[[bytes, Transaction, datetime], MarkedRecord], last: Stamp
) -> tuple[list[MarkedRecord], Stamp]:
    """The records of ``taken``, each created at its transaction's commit time, as the layouts
    without a ``create_time`` column have it: an insert or message still bytes is decoded by
    ``decode``, one decoded while its transaction streamed gets the time now (it was not known
    then). ``last`` is the transaction whose time was computed last, and is returned updated."""
    out: list[MarkedRecord] = []
    last_txn, created = last
    for (txn, _), message in zip(taken, messages(taken), strict=True):
        if txn is not last_txn:
            last_txn, created = txn, EPOCH_2000 + timedelta(microseconds=txn.commit_time)
        if type(message) is bytes:
            out.append(decode(message, txn, created))
        else:
            record = decoded(message)
            record.create_time = created
            out.append(record)
    return out, (last_txn, created)


class LogicalMessages:
    """The slot's logical messages with the outbox's prefix, as records."""

    reads_table = False

    def __init__(self, prefix: str) -> None:
        self._prefix = prefix.encode("utf-8")
        # The last transaction's commit time as a datetime, shared by its records (mark thread only).
        self._created: Stamp = (None, EPOCH_2000)

    def columns(self, conn: psycopg.Connection[Any], table: TableName) -> OutboxColumns:
        """No table: records hold bytes, as Kafka does."""
        return BYTES_COLUMNS

    def transactions(self, oid: int, budget: Budget) -> Transactions:
        """Logical messages with the outbox's prefix (after 'M', the flags and the LSN)."""
        return Transactions(b"M", self._prefix + b"\0", 10, budget=budget)

    def records(self, taken: Taken) -> list[MarkedRecord]:
        out, self._created = stamped(taken, lambda message, _, created: self._record(message, created), self._created)
        return out

    def stream_decoder(self, oid: int) -> ChangeDecoder:
        """As the table's (:meth:`.decoding.TableInserts.stream_decoder`), of the outbox's messages;
        their ``create_time``, the transaction's commit time, is set at hand-out."""
        return _MessageDecoder(self._prefix + b"\0", self._record)

    def _record(self, data: bytes, created: datetime) -> MarkedRecord:
        rid, payload = pgoutput.logical_message(data, len(self._prefix))
        try:
            topic, key, value, headers = message_format.decode(payload)
        except message_format.PayloadError as exc:
            return MarkedRecord(rid, created, "", "", payload, [], malformed=f"payload: {exc}")
        pairs: list[tuple[str, str | bytes | None]] = [(k, v.encode("utf-8")) for k, v in headers]
        return MarkedRecord(rid, created, topic, key, value, pairs)


class _MessageDecoder:
    """The outbox's messages of one transaction streamed in progress (none is decoded natively)."""

    __slots__ = ("_match", "_record")
    fast: tuple[FastInserts, bytes] | None = None

    def __init__(self, match: bytes, record: Callable[[bytes, datetime], MarkedRecord]) -> None:
        self._match, self._record = match, record

    def __call__(self, change: bytes) -> MarkedRecord | None:
        if change[0] != 0x4D or not change.startswith(self._match, 10):  # 'M', after the flags and LSN
            return None
        return self._record(change, EPOCH_2000)

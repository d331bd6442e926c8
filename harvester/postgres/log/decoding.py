"""The outbox table's inserts as records (the layout ``reaper migrate`` and goharvest create): the
:class:`~harvester.postgres.log.parts.Decoding` of the log source over a table, and the helpers the
other layouts' decodings share (:func:`decoded`, :class:`StreamDecoder`)."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from typing import Any, Generic, TypeVar

import psycopg

from harvester.core.records import MarkedRecord
from harvester.postgres.log import pgoutput
from harvester.postgres.log.records import Columns, outbox_record
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import ChangeDecoder, FastInserts, Received
from harvester.postgres.log.transactions import Taken, Transactions, messages
from harvester.postgres.schema import catalog
from harvester.postgres.schema.catalog import OutboxColumns
from harvester.postgres.schema.identifiers import TableName

C = TypeVar("C")  # the columns a stream decoder reads inserts with


class TableInserts:
    """Inserts naming the outbox table, read by :func:`~harvester.postgres.log.records.outbox_record`."""

    reads_table = True

    def columns(self, conn: psycopg.Connection[Any], table: TableName) -> OutboxColumns:
        return catalog.read(conn, table)

    def transactions(self, oid: int, budget: Budget) -> Transactions:
        return Transactions(b"I", oid.to_bytes(4, "big"), 1, oid, budget)

    def records(self, taken: Taken) -> list[MarkedRecord]:
        out: list[MarkedRecord] = []
        for (txn, _), insert in zip(taken, messages(taken), strict=True):
            if type(insert) is bytes:
                assert txn.columns is not None  # checked as the transaction came in
                out.append(outbox_record(insert, txn.columns))
            else:
                out.append(decoded(insert))
        return out

    def stream_decoder(self, oid: int) -> ChangeDecoder:
        """The outbox inserts of a transaction streamed in progress become records as they come,
        with the columns its own Relation message names (the walsender sends it in each streamed
        transaction, before its first change of the table). Decoding so, while the transaction is
        written, takes that work off the drain after its commit. An insert it fails on stays bytes
        (streamed.py): decoded at hand-out, as any other, where the error surfaces."""
        return StreamDecoder(oid, Columns, outbox_record, lambda columns: columns.native)


def decoded(kept: Received) -> MarkedRecord:
    """The record a stream decoder kept, to hand out: itself the first time; a copy after, since the
    record handed out before (it has its stamp) may still be in flight."""
    record: MarkedRecord = kept  # type: ignore[assignment]  # what a decoder kept: a record (no cast: a call per record)
    return record if record.stamp is None else replace(record, headers=list(record.headers), stamp=None)


class StreamDecoder(Generic[C]):
    """A streamed transaction's decoder for the table ``oid``: its inserts become ``record``s with the
    columns ``columns_of`` reads from the transaction's latest Relation message of the table; while
    ``native`` finds a C decoder in those columns, it is the native take of the inserts (``fast``)."""

    __slots__ = ("_columns", "_columns_of", "_match", "_native", "_oid", "_record", "fast")

    def __init__(
        self,
        oid: int,
        columns_of: Callable[[pgoutput.Relation], C],
        record: Callable[[bytes, C], MarkedRecord],
        native: Callable[[C], FastInserts | None] | None = None,
    ) -> None:
        self._oid, self._match = oid, oid.to_bytes(4, "big")
        self._columns_of, self._record, self._native = columns_of, record, native
        self._columns: C | None = None
        self.fast: tuple[FastInserts, bytes] | None = None

    def __call__(self, change: bytes) -> MarkedRecord | None:
        kind = change[0]
        if kind == 0x49:  # Insert
            columns = self._columns
            if columns is None or not change.startswith(self._match, 1):
                return None
            return self._record(change, columns)
        if kind == 0x52:  # Relation
            relation = pgoutput.parse(change)
            if isinstance(relation, pgoutput.Relation) and relation.oid == self._oid:
                self._columns = self.fast = None  # until it is read: a layout the store cannot read raises here
                self._columns = columns = self._columns_of(relation)
                fast = None if self._native is None else self._native(columns)
                self.fast = None if fast is None else (fast, self._match)
        return None

"""The log source over a table of Debezium's outbox layout (``layout: debezium``): its inserts are
the records, made as Debezium's ``EventRouter`` makes them (:mod:`.event_router_rows`).

Many writers of that layout (the Quarkus and Spring outbox extensions) delete each row in the
transaction that inserted it: the row exists only in the log. So :func:`harvester.compose.log_store`
composes :class:`RouterInserts` as the table-less outbox is composed: the position done is stored in
the fence row (:mod:`.position`), no row is deleted per batch, a dead letter's record is copied from
memory and a lost slot cannot be recovered from the table (:class:`.rows.RowLess`). The publication
publishes inserts only: a delete is no record. Rows that stay are left as Debezium leaves them, or,
with a retention window, deleted in bulk once delivered (:mod:`.retention`).
"""

from __future__ import annotations

from datetime import datetime
from typing import Any

import psycopg

from harvester.core.protocols import StoreError
from harvester.core.records import MarkedRecord
from harvester.event_router import EventRouter
from harvester.postgres.log import pgoutput
from harvester.postgres.log.decoding import StreamDecoder
from harvester.postgres.log.event_router_rows import RouterColumns, roles, router_record, unreadable
from harvester.postgres.log.messages import BYTES_COLUMNS, EPOCH_2000, stamped
from harvester.postgres.log.records import Columns
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import ChangeDecoder
from harvester.postgres.log.transactions import Taken, Transaction, Transactions
from harvester.postgres.schema.catalog import OutboxColumns
from harvester.postgres.schema.identifiers import TableName

_COLUMNS_SQL = (
    "SELECT a.attname, a.atttypid::int FROM pg_attribute a"
    " WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped"
)


def missing_columns(conn: psycopg.Connection[Any], table: TableName, router: EventRouter) -> list[str]:
    """Why ``table`` cannot be read as ``router`` reads it: absent, or a column it names absent or
    of a type the log source does not read for it (the stream checks them again as it names them)."""
    types = {str(r[0]): int(r[1]) for r in conn.execute(_COLUMNS_SQL, (table.quoted,)).fetchall()}
    if not types:
        return [f"outbox table {table} does not exist (Debezium's layout: the application creates it)"]
    problems = (unreadable(role, types, str(table)) for role in roles(router, types))
    return [why for why in problems if why is not None]


class RouterInserts:
    """Inserts naming a table of Debezium's layout, read as ``router`` (EventRouter's options)."""

    reads_table = True

    def __init__(self, router: EventRouter) -> None:
        self._router = router

    def columns(self, conn: psycopg.Connection[Any], table: TableName) -> OutboxColumns:
        """The table must have the columns EventRouter reads (their types are checked as the
        stream names them); records hold bytes, as Kafka does."""
        problems = missing_columns(conn, table, self._router)
        if problems:
            raise StoreError(problems[0])
        return BYTES_COLUMNS

    def _columns_of(self, relation: pgoutput.Relation) -> Columns:
        return RouterColumns(relation, self._router)

    def transactions(self, oid: int, budget: Budget) -> Transactions:
        """Inserts naming the table, read by EventRouter's columns."""
        return Transactions(b"I", oid.to_bytes(4, "big"), 1, oid, budget, self._columns_of)

    def records(self, taken: Taken) -> list[MarkedRecord]:
        return stamped(taken, _router_record, (None, EPOCH_2000))[0]

    def stream_decoder(self, oid: int) -> ChangeDecoder:
        """As the table's (:meth:`.decoding.TableInserts.stream_decoder`), with EventRouter's
        columns; the records' ``create_time``, the commit time, is set at hand-out."""
        router = self._router
        return StreamDecoder(oid, lambda relation: RouterColumns(relation, router), router_record)


def _router_record(insert: bytes, txn: Transaction, created: datetime) -> MarkedRecord:
    assert isinstance(txn.columns, RouterColumns)  # checked as the transaction came in
    return router_record(insert, txn.columns, created)

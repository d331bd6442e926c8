"""The log source over a table of Debezium's outbox layout (``layout: debezium``): its inserts are
the records, made as Debezium's ``EventRouter`` makes them (:mod:`.event_router_rows`).

Many writers of that layout (the Quarkus and Spring outbox extensions) delete each row in the
transaction that inserted it: the row exists only in the log. So this store completes as the
table-less outbox does (:mod:`.message_store`): the position done is stored in the fence row, no row
is deleted per batch, a dead letter's record is copied from memory, and a lost slot cannot be
recovered from the table. The publication publishes inserts only: a delete is no record. Rows that
stay are left as Debezium leaves them, or, with a retention window, deleted in bulk once delivered
(:class:`RetainingRouterStore`, as :mod:`.retention`).
"""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg

from harvester.core.protocols import StoreError
from harvester.core.records import MarkedRecord
from harvester.event_router import EventRouter
from harvester.postgres.log import pgoutput
from harvester.postgres.log.event_router_rows import RouterColumns, router_record
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.message_store import _COLUMNS, _EPOCH_2000, MessageStore
from harvester.postgres.log.records import Columns
from harvester.postgres.log.retention import RetainingLogStore
from harvester.postgres.log.store import decoded, stream_decoder
from harvester.postgres.log.transactions import Taken, Transaction, Transactions, messages
from harvester.postgres.schema.catalog import OutboxColumns
from harvester.postgres.schema.identifiers import TableName

_COLUMNS_SQL = (
    "SELECT a.attname FROM pg_attribute a WHERE a.attrelid = to_regclass(%s) AND a.attnum > 0 AND NOT a.attisdropped"
)


def missing_columns(conn: psycopg.Connection[Any], table: TableName, router: EventRouter) -> list[str]:
    """Why ``table`` cannot be read as ``router`` reads it: absent, or a column it names absent."""
    names = {str(r[0]) for r in conn.execute(_COLUMNS_SQL, (table.quoted,)).fetchall()}
    if not names:
        return [f"outbox table {table} does not exist (Debezium's layout: the application creates it)"]
    absent = [c for c in router.columns if c not in names]
    return [f"outbox table {table} has no column {c}, which eventRouter names" for c in absent]


class RouterStore(MessageStore):
    """The log source's store of a Debezium outbox table, read as ``router`` (EventRouter's options)."""

    def __init__(self, dsn: str, setup: LogSetup, router: EventRouter, **options: Any) -> None:
        super().__init__(dsn, setup, **options)
        self._router = router
        # Debezium reads the same rows with the same exposure: a failover that loses the slot loses
        # the rows deleted as they were inserted; this store runs where Debezium runs.
        self._risk_checked = True

    def _read_columns(self, conn: psycopg.Connection[Any]) -> OutboxColumns:
        """The table must have the columns EventRouter reads (their types are checked as the
        stream names them); records hold bytes, as Kafka does."""
        problems = missing_columns(conn, self.table, self._router)
        if problems:
            raise StoreError(problems[0])
        return _COLUMNS

    def _columns_of(self, relation: pgoutput.Relation) -> Columns:
        return RouterColumns(relation, self._router)

    def _outbox_messages(self) -> Transactions:
        """Inserts naming the table, read by EventRouter's columns."""
        super(MessageStore, self)._outbox_messages()  # the table's oid, as the log store finds it
        oid = self._outbox_oid
        return Transactions(b"I", oid.to_bytes(4, "big"), 1, oid, self._budget, self._columns_of)

    def _records(self, taken: Taken) -> list[MarkedRecord]:
        out: list[MarkedRecord] = []
        last: Transaction | None = None
        created = _EPOCH_2000
        for (txn, _), insert in zip(taken, messages(taken), strict=True):
            if txn is not last:
                last, created = txn, _EPOCH_2000 + timedelta(microseconds=txn.commit_time)
            if type(insert) is bytes:
                assert isinstance(txn.columns, RouterColumns)  # checked as the transaction came in
                out.append(router_record(insert, txn.columns, created))
            else:
                record = decoded(insert)
                record.create_time = created  # not known while the transaction streamed
                out.append(record)
        return out

    def _stream_decoder(self) -> Callable[[bytes], MarkedRecord | None]:
        """As the log store's (:meth:`LogStore._stream_decoder`), with EventRouter's columns; the
        records' ``create_time``, the commit time, is set at hand-out."""
        router = self._router
        return stream_decoder(self._outbox_oid, lambda relation: RouterColumns(relation, router), router_record)


class RetainingRouterStore(RouterStore, RetainingLogStore):
    """:class:`RouterStore` whose delivered rows that stay are deleted in bulk, at least
    ``retention`` seconds after their delivery (:mod:`.retention`)."""

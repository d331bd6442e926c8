"""The table-less outbox: records written as transactional logical decoding messages
(``pg_logical_emit_message(true, <prefix>, <payload>)``, :mod:`harvester.postgres.schema.message_format`)
and read by the log source from the slot, with no table and so nothing to delete.

Everything the log source does about the stream, terms, passes and confirmations stays
(:class:`~harvester.postgres.log.store.LogStore`); what takes the place of the delete is the
position stored in the fence row (:mod:`harvester.postgres.log.position`).

A record's id is its message's LSN: unique, the same in every term (the slot sends the same WAL
records again), and what the identity headers, the checkpoints and the dead-letter table carry.
Its ``create_time`` is its transaction's commit time.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from datetime import UTC, datetime, timedelta
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from harvester.core.protocols import StoreError
from harvester.core.records import ColumnLimits, Failure, MarkedRecord
from harvester.postgres.connections import error_text
from harvester.postgres.log import logical, pgoutput
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.position import PositionedLogStore
from harvester.postgres.log.store import decoded
from harvester.postgres.log.transactions import Taken, Transaction, Transactions, messages
from harvester.postgres.schema import message_format, migrations
from harvester.postgres.schema.catalog import OutboxColumns

_EPOCH_2000 = datetime(2000, 1, 1, tzinfo=UTC)
# What a record may hold: whatever Kafka accepts (the stasher checks only the record itself).
_COLUMNS = OutboxColumns(
    ColumnLimits(key_max_chars=None, value_max_chars=None, value_kind="bytes"),
    key_type="text",
    value_type="bytea",
    header_defaults=True,
    tracks_attempts=False,
)
_DEAD_ROW = (
    "(%s::bigint, %s::timestamptz, %s::text, %s::text, %s::bytea, %s::text[], %s::text[], %s::text, %s::text,"
    " %s::int, %s::timestamptz)"
)


class FailoverRiskError(StoreError):
    """A table-less outbox whose records a failover would lose, and no setting that accepts it."""


class MessageStore(PositionedLogStore):
    """:class:`PositionedLogStore` of a table-less outbox, whose records are the slot's logical messages with
    the outbox's prefix (``setup.prefix``)."""

    _recoverable = False  # its records exist only in the log: a lost slot stops the leader

    def __init__(self, dsn: str, setup: LogSetup, **options: Any) -> None:
        super().__init__(dsn, setup, **options)
        self._prefix = (setup.prefix or "").encode("utf-8")  # none: a subclass reads a table's inserts
        self._content: dict[int, MarkedRecord] = {}  # handed out, not done: what a dead letter keeps
        # The last transaction's commit time as a datetime, shared by its records (mark thread only).
        self._created: tuple[Transaction | None, datetime] = (None, _EPOCH_2000)
        self._risk_checked = False
        self._bytes_dead_letters = False  # its dead-letter table, whose values are bytes, is ensured

    def prepare(self) -> Any:
        """As the log store's, and once, at the first: refuse to run where a failover would lose
        records (:func:`~harvester.postgres.log.logical.failover_risk`). Not again at a later term: the
        new primary after a failover may have no standby yet, and stopping then loses nothing."""
        columns = super().prepare()
        if not self._risk_checked:
            try:
                risk = logical.failover_risk(self.db.conn(), self._setup)
            except psycopg.Error as exc:
                raise StoreError(f"checking the slot's failover failed: {error_text(exc)}") from exc
            if risk is not None:
                raise FailoverRiskError(risk)
            self._risk_checked = True
        return columns

    def _read_columns(self, conn: psycopg.Connection[Any]) -> OutboxColumns:
        """No table: records hold bytes, as Kafka does."""
        return _COLUMNS

    def _outbox_messages(self) -> Transactions:
        """Logical messages with the outbox's prefix (after 'M', the flags and the LSN)."""
        return Transactions(b"M", self._prefix + b"\0", 10, budget=self._budget)

    # ------------------------------------------------------------------ reading

    def _records(self, taken: Taken) -> list[MarkedRecord]:
        out: list[MarkedRecord] = []
        for (txn, _), message in zip(taken, messages(taken), strict=True):
            last, created = self._created
            if txn is not last:
                created = _EPOCH_2000 + timedelta(microseconds=txn.commit_time)
                self._created = (txn, created)
            if type(message) is bytes:
                out.append(self._record(message, created))
            else:
                record = decoded(message)
                record.create_time = created  # not known while the transaction streamed
                out.append(record)
        return out

    def _stream_decoder(self) -> Callable[[bytes], MarkedRecord | None]:
        """As the log store's (:meth:`LogStore._stream_decoder`), of the outbox's messages; their
        ``create_time``, the transaction's commit time, is set at hand-out."""
        match = self._prefix + b"\0"

        def decode(change: bytes) -> MarkedRecord | None:
            if change[0] != 0x4D or not change.startswith(match, 10):  # 'M', after the flags and LSN
                return None
            return self._record(change, _EPOCH_2000)

        return decode

    def _record(self, data: bytes, created: datetime) -> MarkedRecord:
        rid, payload = pgoutput.logical_message(data, len(self._prefix))
        try:
            topic, key, value, headers = message_format.decode(payload)
        except message_format.PayloadError as exc:
            return MarkedRecord(rid, created, "", "", payload, [], malformed=f"payload: {exc}")
        pairs: list[tuple[str, str | bytes | None]] = [(k, v.encode("utf-8")) for k, v in headers]
        return MarkedRecord(rid, created, topic, key, value, pairs)

    def _gone(self, taken: Taken, records: list[MarkedRecord]) -> set[int]:
        """None: a new term skips what an earlier one stored done (see :meth:`acquire`)."""
        return set()

    def _fresh(self, taken: Taken) -> list[MarkedRecord]:
        out = super()._fresh(taken)
        with self._state:
            self._content.update((r.id, r) for r in out)
        return out

    # ------------------------------------------------------------------ completion

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        """Write the records into the dead-letter table (one fenced statement); they count as done."""
        if not failures:
            return
        if not self._bytes_dead_letters:
            try:
                migrations.ensure(self.db.conn(), self.table, "dead_letter", value_type="BYTEA")
            except psycopg.Error as exc:
                raise StoreError(f"creating the dead-letter table failed: {error_text(exc)}") from exc
            self._bytes_dead_letters = True
        rows: list[Any] = []
        for f in failures:
            with self._state:
                r = self._content.get(f.id)
            if r is None:
                continue  # done meanwhile (a retry after the statement committed)
            hkeys = [k for k, _ in r.headers]
            hvalues = [v.decode("utf-8", "replace") if isinstance(v, bytes) else v for _, v in r.headers]
            rows += [f.id, r.create_time, r.topic, r.key, r.value, hkeys, hvalues, f.reason, f.error, f.attempts]
            rows.append(f.first_failure)
        if rows:
            values = sql.SQL(", ").join([sql.SQL(_DEAD_ROW)] * (len(rows) // 11))
            statement = sql.SQL(
                "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND shard = %s AND epoch = %s FOR SHARE)"
                " INSERT INTO {d} (id, create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys,"
                " kafka_header_values, reason, error, attempts, first_failure, last_failure, epoch, leader_id)"
                " SELECT v.id, v.ct, v.topic, v.key, v.value, v.hk, v.hv, v.reason, v.err, v.attempts,"
                " coalesce(v.first, now()), now(), %s, %s::uuid FROM (VALUES {values})"
                " AS v(id, ct, topic, key, value, hk, hv, reason, err, attempts, first)"
                " WHERE EXISTS (SELECT 1 FROM fence) ON CONFLICT (id) DO NOTHING"
            ).format(
                f=migrations.fence_table(self.table).ident,
                d=migrations.dead_letter_table(self.table).ident,
                values=values,
            )
            cur = self.db.execute(statement, (*self.fence.guard, self.fence.epoch, leader_id, *rows))
            if cur.rowcount < len(rows) // 11:
                self.fence.check_epoch()
        self._done([f.id for f in failures], purged=False)

    def _drop_kept(self, ids: Sequence[int]) -> None:
        for rid in ids:
            self._content.pop(rid, None)

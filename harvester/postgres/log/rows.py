"""Whether the log source's records are rows of the outbox table too (the :class:`Rows` part of a log
store, :mod:`.parts`).

:class:`TableRows`: the table holds a row per record until it is deleted, so a dead letter moves its
row, a new term skips the records whose rows an earlier one deleted, and a lost slot is recovered
from the rows (:mod:`.recovery`). :class:`RowLess`: the records exist only in the log (the
table-less outbox, :mod:`.messages`; a table of Debezium's layout whose writers delete each row as
they insert it, :mod:`.event_router_rows`): a dead letter's record is copied from memory, kept from
its hand-out until it is done, and a lost slot stops the leader.
"""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any
from uuid import UUID

import psycopg
from psycopg import sql

from harvester.core.protocols import StoreError
from harvester.core.records import Failure, MarkedRecord
from harvester.postgres.connections import error_text
from harvester.postgres.log import logical
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.parts import Ledger
from harvester.postgres.log.transactions import Taken
from harvester.postgres.schema import migrations
from harvester.postgres.schema.identifiers import TableName

_DEAD_ROW = (
    "(%s::bigint, %s::timestamptz, %s::text, %s::text, %s::bytea, %s::text[], %s::text[], %s::text, %s::text,"
    " %s::int, %s::timestamptz)"
)


class FailoverRiskError(StoreError):
    """A table-less outbox whose records a failover would lose, and no setting that accepts it."""


class TableRows:
    """Records that are rows of the outbox table."""

    recoverable = True

    def __init__(self, table: TableName) -> None:
        self._present = sql.SQL("SELECT id FROM {} WHERE id = ANY(%s::bigint[])").format(table.ident)

    def bind(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def prepared(self, setup: LogSetup) -> None:
        """Nothing to check: a failover loses no row."""

    def gone(self, taken: Taken, records: list[MarkedRecord], term_lsn: int) -> set[int]:
        """As the table says (again, they would be duplicates a de-duplicating reader may miss, their
        key having moved on)."""
        # By the commit record's start, known from the Begin: a superset of those ending before it.
        if not taken or taken[0][0].commit_lsn > term_lsn:
            return set()  # commit order: none of them committed before this term
        earlier = [record.id for (txn, _), record in zip(taken, records, strict=True) if txn.commit_lsn <= term_lsn]
        existing = {int(row[0]) for row in self._ledger.db.run(self._present, (earlier,))}
        return set(earlier) - existing

    def handed_out(self, records: list[MarkedRecord]) -> None:
        """Nothing kept: the row holds the record."""

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> bool:
        """Move the rows into the dead-letter table."""
        self._ledger.move_dead_letters(failures, leader_id)
        return True

    def forget(self, ids: Sequence[int]) -> None:
        """Nothing kept."""


class RowLess:
    """Records that exist only in the log. ``check_failover``: refuse to run where a failover would
    lose them (the table-less outbox; Debezium's layout runs where Debezium runs, with the same
    exposure)."""

    recoverable = False  # its records exist only in the log: a lost slot stops the leader

    def __init__(self, table: TableName, *, check_failover: bool) -> None:
        self._fence_row = migrations.fence_table(table).ident
        self._dead_letters = migrations.dead_letter_table(table).ident
        self._content: dict[int, MarkedRecord] = {}  # handed out, not done: what a dead letter keeps
        self._risk_checked = not check_failover
        self._bytes_dead_letters = False  # its dead-letter table, whose values are bytes, is ensured

    def bind(self, ledger: Ledger) -> None:
        self._ledger = ledger

    def prepared(self, setup: LogSetup) -> None:
        """Once, at the first: refuse to run where a failover would lose records
        (:func:`~harvester.postgres.log.logical.failover_risk`). Not again at a later term: the new
        primary after a failover may have no standby yet, and stopping then loses nothing."""
        if self._risk_checked:
            return
        try:
            risk = logical.failover_risk(self._ledger.db.conn(), setup)
        except psycopg.Error as exc:
            raise StoreError(f"checking the slot's failover failed: {error_text(exc)}") from exc
        if risk is not None:
            raise FailoverRiskError(risk)
        self._risk_checked = True

    def gone(self, taken: Taken, records: list[MarkedRecord], term_lsn: int) -> set[int]:
        """None: a new term skips what an earlier one stored done (:mod:`.position`)."""
        return set()

    def handed_out(self, records: list[MarkedRecord]) -> None:
        self._content.update((r.id, r) for r in records)

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> bool:
        """Write the records into the dead-letter table (one fenced statement)."""
        if not failures:
            return False
        ledger = self._ledger
        if not self._bytes_dead_letters:
            try:
                migrations.ensure(ledger.db.conn(), ledger.table, "dead_letter", value_type="BYTEA")
            except psycopg.Error as exc:
                raise StoreError(f"creating the dead-letter table failed: {error_text(exc)}") from exc
            self._bytes_dead_letters = True
        rows: list[Any] = []
        for f in failures:
            with ledger.state:
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
            ).format(f=self._fence_row, d=self._dead_letters, values=values)
            cur = ledger.db.execute(statement, (*ledger.fence.guard, ledger.fence.epoch, leader_id, *rows))
            if cur.rowcount < len(rows) // 11:
                ledger.fence.check_epoch()
        return True

    def forget(self, ids: Sequence[int]) -> None:
        for rid in ids:
            self._content.pop(rid, None)

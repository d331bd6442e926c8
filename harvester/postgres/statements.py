"""The SQL of mark-purge/reset over one outbox table, built once from the table's shape.

Every change runs in one statement that first share-locks the fence row at this process's epoch
(the ``fence`` CTE): after a newer epoch commits, the CTE is empty and nothing changes. That is
the "no change past a fence" guarantee (tested in ``tests/fence``).
"""

from __future__ import annotations

from dataclasses import dataclass

from psycopg import sql

from harvester.postgres.catalog import OutboxColumns
from harvester.postgres.identifiers import TableName
from harvester.postgres.migrations import dead_letter_table, fence_table

_RETURNING = "id, create_time, kafka_topic, kafka_key, {value}, kafka_header_keys, kafka_header_values, {attempts}"
_GUARD = "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND epoch = %s FOR SHARE) "


# The mark takes its ids as an array (``id = ANY(ARRAY(...))``), not as ``id IN (subquery)``: the
# planner then finds the rows by the primary key whatever it believes about the table's size, where
# a join could choose a whole-table scan on the stale statistics of an outbox that was empty a moment
# ago (tests/engine/test_plans.py).


@dataclass(frozen=True, slots=True)
class Statements:
    """The store's statements; each guarded one takes (table, epoch) as its first parameters."""

    mark: sql.Composed
    purge: sql.Composed
    reset: sql.Composed
    fail: sql.Composed | None  # None without the attempt columns: a failure is a reset then
    dead_letter: sql.Composed
    acquire: sql.Composed
    epoch: sql.Composed
    checkpoint_position: sql.Composed
    purge_checkpointed: sql.Composed
    head: sql.Composed

    @classmethod
    def build(cls, table: TableName, columns: OutboxColumns, *, hold_dead_letter_keys: bool) -> Statements:
        """The statements for ``table``; with ``hold_dead_letter_keys`` the mark skips keys that
        have a dead letter."""
        t, f = table.ident, fence_table(table).ident
        dead = dead_letter_table(table).ident
        value = "kafka_value::text" if columns.limits.value_kind == "json" else "kafka_value"
        attempts = "harvest_attempts, harvest_first_failure" if columns.tracks_attempts else "0, NULL::timestamptz"
        held: sql.Composable = sql.SQL("")
        if hold_dead_letter_keys:
            held = sql.SQL(" AND NOT EXISTS (SELECT 1 FROM {d} WHERE {d}.kafka_key = {t}.kafka_key)")
            held = held.format(d=dead, t=t)
        fail = None
        if columns.tracks_attempts:
            fail = sql.SQL(
                _GUARD + "UPDATE {t} SET leader_id = NULL, harvest_attempts = harvest_attempts + 1,"
                " harvest_first_failure = coalesce(harvest_first_failure, now()), harvest_last_error = u.err"
                " FROM unnest(%s::bigint[], %s::text[]) AS u(id, err)"
                " WHERE EXISTS (SELECT 1 FROM fence) AND {t}.id = u.id"
            ).format(t=t, f=f)
        return cls(
            mark=sql.SQL(
                _GUARD + "UPDATE {t} SET leader_id = %s WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(ARRAY("
                "SELECT id FROM {t} WHERE (leader_id IS NULL OR leader_id <> %s){held} ORDER BY id LIMIT %s)) "
                "RETURNING " + _RETURNING.format(value=value, attempts=attempts)
            ).format(t=t, f=f, held=held),
            purge=sql.SQL(
                _GUARD + "DELETE FROM {t} WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(%s::bigint[])"
            ).format(t=t, f=f),
            reset=sql.SQL(
                _GUARD + "UPDATE {t} SET leader_id = NULL WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(%s::bigint[])"
            ).format(t=t, f=f),
            fail=fail,
            dead_letter=sql.SQL(
                _GUARD + ", moved AS (DELETE FROM {t} WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(%s::bigint[])"
                " RETURNING *) INSERT INTO {d} (id, create_time, kafka_topic, kafka_key, kafka_value,"
                " kafka_header_keys, kafka_header_values, reason, error, attempts, first_failure, last_failure,"
                " epoch, leader_id)"
                " SELECT m.id, m.create_time, m.kafka_topic, m.kafka_key, m.kafka_value, m.kafka_header_keys,"
                " m.kafka_header_values, u.reason, u.err, u.attempts, coalesce(u.first, now()), now(), %s, %s"
                " FROM moved m JOIN unnest(%s::bigint[], %s::text[], %s::text[], %s::int[], %s::timestamptz[])"
                " AS u(id, reason, err, attempts, first) ON u.id = m.id ON CONFLICT (id) DO NOTHING"
            ).format(t=t, d=dead, f=f),
            acquire=sql.SQL(
                "INSERT INTO {f} AS x (outbox_table, epoch, leader_id) VALUES (%s, 1, %s) "
                "ON CONFLICT (outbox_table) DO UPDATE SET epoch = x.epoch + 1, leader_id = excluded.leader_id,"
                " acquired_at = now() RETURNING epoch"
            ).format(f=f),
            epoch=sql.SQL("SELECT epoch FROM {} WHERE outbox_table = %s").format(f),
            checkpoint_position=sql.SQL("SELECT checkpoint_position FROM {} WHERE outbox_table = %s").format(f),
            # FOR UPDATE: the row lock also orders this against a newer leader's bump.
            purge_checkpointed=sql.SQL(
                "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND epoch = %s FOR UPDATE),"
                " gone AS (DELETE FROM {t} WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(%s::bigint[]))"
                " UPDATE {f} SET checkpoint_position = greatest(checkpoint_position, %s)"
                " WHERE outbox_table = %s AND EXISTS (SELECT 1 FROM fence)"
            ).format(t=t, f=f),
            head=sql.SQL(
                "SELECT (SELECT id FROM {t} ORDER BY id LIMIT 1), (SELECT id FROM {t} ORDER BY id DESC LIMIT 1),"
                " extract(epoch FROM now() - (SELECT create_time FROM {t} ORDER BY id LIMIT 1))::float8"
            ).format(t=t),
        )

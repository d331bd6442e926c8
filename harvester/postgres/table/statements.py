"""The SQL of mark-purge/reset over one outbox table, built once from the table's shape.

Every statement first share-locks the fence row at this process's epoch (the ``fence`` CTE; the
statements on the fence rows themselves are :mod:`harvester.postgres.schema.fencing`'s):
after a newer epoch commits, the CTE is empty, nothing changes and the mark returns nothing. That
is the "no change past a fence" guarantee (tested in ``tests/fence``).

The mark is a read: the leader keeps the ids it has handed out in memory (see
:class:`harvester.postgres.table.store.PostgresStore`) instead of writing its leader id into every row,
which halves the row versions a record costs.
"""

from __future__ import annotations

from collections.abc import Iterable, Sequence
from dataclasses import dataclass

from psycopg import sql

from harvester.postgres.schema.catalog import OutboxColumns
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table, fence_table
from harvester.postgres.schema.sharding import shard_expression
from harvester.postgres.table.rows import MALFORMED_SQL

_RETURNING = "id, create_time, kafka_topic, kafka_key, {value}, kafka_header_keys, kafka_header_values, {attempts}"
_GUARD = "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND shard = %s AND epoch = %s FOR SHARE) "
# The ids a purge is given, as a sub-select: the planner does not see how many there are and reads
# them by the primary key, where 500 literal ids against the statistics of an outbox that was empty
# a moment ago make a whole-table scan look cheaper (tests/engine/test_plans.py).
_IDS = "ANY((SELECT %s::bigint[])::bigint[])"
# The ids a mark skips, by contrast, are a plain parameter: with custom plans (PLANNER_OPTIONS) the
# array is a constant of the plan, which PostgreSQL (15 and later) hashes once per statement, so
# each row the mark reads past costs one lookup. Behind a sub-select the array was the result of an
# InitPlan, compared with each row id by id: a mark skipping 3,000 ids took about 65 ms on the
# server instead of about 2 (docs/benchmarks.md#sharding). What the planner now sees of the ids cannot lead it
# away from the index walk: with sorts off, only an index gives the mark's order.
_SKIP = "ALL(%s::bigint[])"
# A purge of ids close together (a burst's acknowledgements: consecutive ids, some still in flight)
# walks their range of the primary key once and keeps the given ids, instead of one descent of the
# index per id: about a quarter less of the server's CPU per deleted row. Ids far apart would walk
# every row between them: those keep the descents (``purge``). The ids are a bitmap over the range
# (``id_bitmap``), one bit read per row walked: 0.85-0.91 µs of backend CPU per row deleted against
# 1.03-1.21 with the ids as an array, which the planner estimated element by element and the
# executor hashed (docs/benchmarks.md, "Decoded in 1 MB steps, purged by a bitmap").
_IN_RANGE = "id BETWEEN %s AND %s AND get_bit(%s::bytea, (id - %s)::int) = 1"
# A purge of every id of a range (a burst's acknowledgements often are: 50-60% of the ids of a
# 1,000,000-record drain) is the range alone, with nothing to look up per row: 0.57-0.73 µs of
# backend CPU per row deleted, against 0.9-1.0 for the range with the ids as an array (before the
# bitmap), 8% less of the deleting backend's CPU in such a drain (docs/benchmarks.md).
_WHOLE_RANGE = "id BETWEEN %s AND %s"

# The options of every store connection. Custom plans: a generic plan made while the outbox was
# small (an idle outbox, before a burst) would scan the whole table on every mark and purge until
# autoanalyze ran, and would not hash the skipped ids; a custom plan sees the table's current size
# and the ids each time, for a fraction of a millisecond of planning. No sorts where another plan
# exists: the mark asks for its rows in id order ((shard, id) with shards), which only the primary
# key (the shard's index) gives unsorted, so no statistics, stale or fresh, lead the planner to a
# scan of the whole table (shard) and a sort of it (120 ms per mark of a 200,000-row burst with the
# statistics of an empty outbox, instead of 1 ms). No statement of the store needs to sort many rows.
PLANNER_OPTIONS = "-c plan_cache_mode=force_custom_plan -c enable_sort=off"


def dense_range(ids: Sequence[int]) -> tuple[int, int] | None:
    """The lowest and highest of ``ids`` when they lie close enough together for ``purge_range`` (a
    range of at most 4 ids per id given), else None."""
    low, high = min(ids), max(ids)
    return (low, high) if high - low < 4 * len(ids) else None


def whole_range(ids: Sequence[int], low: int, high: int) -> bool:
    """Whether ``ids``, from ``low`` to ``high``, are every id of that range (``purge_run``)."""
    return high - low + 1 == len(ids) and len(set(ids)) == len(ids)


def id_bitmap(ids: Iterable[int], low: int, high: int) -> bytes:
    """``ids``, from ``low`` to ``high``, as the bits of a ``bytea``: bit ``id - low`` set (the
    order ``get_bit`` reads them in, lowest bit of each byte first)."""
    bits = bytearray(((high - low) >> 3) + 1)
    for i in ids:
        at = i - low
        bits[at >> 3] |= 1 << (at & 7)
    return bytes(bits)


def id_array(ids: Iterable[int]) -> str:
    """``ids`` as the text of a ``bigint[]``: the parameter of the ids a purge is given and of the
    ids a mark skips. psycopg dumps a Python list id by id in Python, about 0.8 µs an id; the text
    costs about a quarter of that. It counts because a mark sends every id its shard has handed out
    and not settled: about 700 per mark with one shard, about 3,000 with four in one process (each
    shard marks ahead behind its fewer keys), 5 times the ids per record (docs/benchmarks.md#sharding)."""
    return "{" + ",".join(map(str, ids)) + "}"


@dataclass(frozen=True, slots=True)
class Statements:
    """The store's statements; each guarded one takes (table, epoch) as its first parameters."""

    mark: sql.Composed
    pending: sql.Composed
    purge: sql.Composed
    purge_range: sql.Composed  # parameters: (table, epoch), lowest id, highest id, id_bitmap, lowest id
    purge_run: sql.Composed  # parameters: (table, epoch), lowest id, highest id
    fail: sql.Composed | None  # None without the attempt columns: a failure is a reset then
    dead_letter: sql.Composed
    purge_checkpointed: sql.Composed
    head: sql.Composed

    @classmethod
    def build(
        cls, table: TableName, columns: OutboxColumns, *, hold_dead_letter_keys: bool, shards: int = 1
    ) -> Statements:
        """The statements for ``table``; with ``hold_dead_letter_keys`` the mark skips keys that
        have a dead letter. With ``shards`` > 1 the mark takes the shard and the next one as two
        more parameters (before the ids it skips) and reads only that shard's rows."""
        t, f = table.ident, fence_table(table).ident
        dead = dead_letter_table(table).ident
        value = "kafka_value::text" if columns.limits.value_kind == "json" else "kafka_value"
        attempts = "harvest_attempts, harvest_first_failure" if columns.tracks_attempts else "0, NULL::timestamptz"
        held: sql.Composable = sql.SQL("")
        if hold_dead_letter_keys:
            held = sql.SQL(" AND NOT EXISTS (SELECT 1 FROM {d} WHERE {d}.kafka_key = {t}.kafka_key)")
            held = held.format(d=dead, t=t)
        own: sql.Composable = sql.SQL("")
        order: sql.Composable = sql.SQL("id")
        ordered: sql.Composable = sql.SQL(" ORDER BY id")
        if shards > 1:
            # A range, not an equality, over the shard and an order by (shard, id): only the shard's
            # index yields that order without sorting, and the store's connections turn sorts off
            # (PLANNER_OPTIONS), so no statistics, stale or fresh, can lead the planner to another
            # shard's rows (a primary-key walk filtering the shard) or to sorting them all.
            # The store sorts the few rows it reads instead of the outer ORDER BY.
            expression = shard_expression(shards)
            own = sql.SQL("{e} >= %s AND {e} < %s AND ").format(e=expression)
            order = sql.SQL("{}, id").format(expression)
            ordered = sql.SQL("")

        def deleting(rows: str) -> sql.Composed:
            """A purge: the fenced delete of the ``rows`` a condition names."""
            return sql.SQL(_GUARD + "DELETE FROM {t} WHERE EXISTS (SELECT 1 FROM fence) AND " + rows).format(t=t, f=f)

        fail = None
        if columns.tracks_attempts:
            fail = sql.SQL(
                _GUARD + "UPDATE {t} SET harvest_attempts = harvest_attempts + 1,"
                " harvest_first_failure = coalesce(harvest_first_failure, now()), harvest_last_error = u.err"
                " FROM unnest(%s::bigint[], %s::text[]) AS u(id, err)"
                " WHERE EXISTS (SELECT 1 FROM fence) AND {t}.id = u.id"
            ).format(t=t, f=f)
        return cls(
            # Every row past the frontier not handed out yet, whatever its id: a transaction that
            # commits late (lower ids, visible after higher ones were harvested) is found by the next
            # mark, the frontier staying below its ids until it ended (frontier.py). The ids come
            # as an array (``id = ANY(ARRAY(...))``): the planner then reads them by the primary key
            # whatever it believes about the table's size, where the plain ``ORDER BY id LIMIT``
            # chose a whole-table scan and sort on the statistics of an outbox that was empty a
            # moment ago (tests/engine/test_plans.py).
            mark=sql.SQL(
                _GUARD + "SELECT " + _RETURNING.format(value=value, attempts=attempts) + " FROM {t}"
                " WHERE EXISTS (SELECT 1 FROM fence) AND id = ANY(ARRAY(SELECT id FROM {t}"
                " WHERE {own}id >= %s AND id <> " + _SKIP + "{held} ORDER BY {order} LIMIT %s)){ordered}"
            ).format(t=t, f=f, own=own, held=held, order=order, ordered=ordered),
            # The mark's choice of rows, ids only: a Spark drain plans a micro-batch with it and its
            # executors read the rows (harvester.spark.drain); with why a row is malformed, and its
            # topic and size, for the dead-letter table (10: a header's two length varints, at most).
            # octet_length of a text or bytea column reads its length from the TOAST header, not the value.
            pending=sql.SQL(
                _GUARD + "SELECT id, {bad}, kafka_topic, coalesce(octet_length(kafka_key), 0)"
                " + coalesce(octet_length({value}), 0) + coalesce((SELECT sum(coalesce(octet_length(k), 0)"
                " + coalesce(octet_length(v), 0) + 10)"
                " FROM unnest(kafka_header_keys, kafka_header_values) AS h(k, v)), 0)"
                " FROM {t} WHERE EXISTS (SELECT 1 FROM fence)"
                " AND {own}id <> " + _SKIP + "{held} ORDER BY {order} LIMIT %s"
            ).format(t=t, f=f, own=own, held=held, order=order, bad=MALFORMED_SQL, value=sql.SQL(value)),
            purge=deleting("id = " + _IDS),
            purge_range=deleting(_IN_RANGE),
            purge_run=deleting(_WHOLE_RANGE),
            fail=fail,
            dead_letter=sql.SQL(
                _GUARD + ", moved AS (DELETE FROM {t} WHERE EXISTS (SELECT 1 FROM fence)"
                " AND id = " + _IDS + " RETURNING *)"
                " INSERT INTO {d} (id, create_time, kafka_topic, kafka_key, kafka_value,"
                " kafka_header_keys, kafka_header_values, reason, error, attempts, first_failure, last_failure,"
                " epoch, leader_id)"
                " SELECT m.id, m.create_time, m.kafka_topic, m.kafka_key, m.kafka_value, m.kafka_header_keys,"
                " m.kafka_header_values, u.reason, u.err, u.attempts, coalesce(u.first, now()), now(), %s, %s"
                " FROM moved m JOIN unnest(%s::bigint[], %s::text[], %s::text[], %s::int[], %s::timestamptz[])"
                " AS u(id, reason, err, attempts, first) ON u.id = m.id ON CONFLICT (id) DO NOTHING"
            ).format(t=t, d=dead, f=f),
            # FOR UPDATE: the row lock also orders this against a newer leader's bump.
            purge_checkpointed=sql.SQL(
                "WITH fence AS (SELECT 1 FROM {f} WHERE outbox_table = %s AND shard = %s AND epoch = %s"
                " FOR UPDATE), gone AS (DELETE FROM {t} WHERE EXISTS (SELECT 1 FROM fence) AND id = " + _IDS + ")"
                " UPDATE {f} SET checkpoint_position = greatest(checkpoint_position, %s)"
                " WHERE outbox_table = %s AND shard = %s AND EXISTS (SELECT 1 FROM fence)"
            ).format(t=t, f=f),
            head=sql.SQL(
                "SELECT (SELECT id FROM {t} ORDER BY id LIMIT 1), (SELECT id FROM {t} ORDER BY id DESC LIMIT 1),"
                " extract(epoch FROM now() - (SELECT create_time FROM {t} ORDER BY id LIMIT 1))::float8"
            ).format(t=t),
        )

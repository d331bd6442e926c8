"""Sharded harvesting in SQL: which rows belong to a shard, the index a shard's mark query walks,
and the number of shards a group of reapers agreed on (recorded with the fence).

A shard's rows are those whose key hashes to it (:func:`harvester.core.shards.shard_of`, computed
here by the same expression). The mark query of shard ``i`` asks for the rows with
``i <= shard_expression(N) < i + 1`` in (shard, id) order: an index on ``(shard_expression(N), id)``
answers that by reading only shard ``i``'s entries, lowest id first, whatever the other shards hold
(the store's connections plan without sorts, :data:`harvester.postgres.table.statements.PLANNER_OPTIONS`;
``tests/shards/test_store.py`` shows the plan, with stale statistics and with fresh ones). The
expression includes N, so each N has an index of its own; ``reaper migrate`` and the harvester's
start create it (:func:`harvester.postgres.schema.migrations.ensure_shard_index`).
"""

from __future__ import annotations

from psycopg import sql

from harvester.postgres.schema.identifiers import TableName


def shard_expression(shards: int) -> sql.Composable:
    """The shard of a row's ``kafka_key``, as SQL; spelled exactly as the index spells it, so the
    planner matches the two."""
    return sql.SQL("mod(('x' || left(md5(coalesce(kafka_key::text, '')), 8))::bit(32)::bigint, {})").format(
        sql.Literal(int(shards))
    )


def shard_index(table: TableName, shards: int) -> TableName:
    """The index of ``table``'s shards when there are ``shards`` of them (in ``table``'s schema)."""
    return TableName(table.schema, f"{table.name}_shard{shards}_idx"[:63])


def mismatch(table: TableName, configured: int, recorded: int) -> str:
    """The one-line refusal of a reaper whose number of shards is not the recorded one."""
    return (
        f"harvest.shards is {configured} but {table.qualified} is harvested with {recorded} shards: "
        f"every reaper of a group must use the same number (to change it, see docs/sharding.md)"
    )

"""Records Kafka refused for good, moved to the dead-letter table under their shard's fence, as a
reaper's settle moves them: by the ``outbox-publish`` sink's commit (on the driver) and by the drain's
tasks that publish what they read (``option("publish", "true")``, on an executor).

The term is found by its epoch, unique per outbox: a term superseded meanwhile dead-letters
nothing, and its records stay for the shard's new owner, whose mark sends them again."""

from __future__ import annotations

from collections.abc import Sequence

import psycopg
import structlog
from psycopg import sql

from harvester.core.protocols import FencedError
from harvester.core.records import Failure
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table
from harvester.postgres.table.store import PostgresStore
from harvester.spark.retry import retrying

log = structlog.get_logger("harvester.spark.publish")

_APPLICATION = "outbox-harvester-spark"


def dead_letter(dsn: str, table: TableName, epoch: int, failures: Sequence[Failure], batch: int) -> int:
    """Move ``failures`` (published under ``epoch``) to the dead-letter table; return how many were
    moved (0 when a newer term took their shard)."""
    if not failures:
        return 0
    fence = sql.SQL("SELECT shard, shards, leader_id FROM {} WHERE outbox_table = %s AND epoch = %s").format(
        fence_table(table).ident
    )
    with psycopg.connect(dsn, application_name=_APPLICATION) as conn:
        term = conn.execute(fence, (table.qualified, epoch)).fetchone()
    if term is None:
        log.warning("dead_letters_fenced", epoch=epoch, records=len(failures), batch=batch)
        return 0
    shard, shards, leader_id = int(term[0]), int(term[1]), term[2]
    store = PostgresStore(dsn, table, application_name=_APPLICATION, shard=shard, shards=shards)
    try:
        store.prepare()
        store.join(epoch)
        retrying(lambda: store.dead_letter(failures, leader_id))
    except FencedError:
        log.warning("dead_letters_fenced", epoch=epoch, records=len(failures), batch=batch)
        return 0
    finally:
        store.close()
    for f in failures:
        log.error("dead_lettered", id=f.id, key=f.key, reason=f.reason, attempts=f.attempts, error=f.error)
    return len(failures)

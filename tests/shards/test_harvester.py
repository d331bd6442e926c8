"""One Harvester leading every shard of an outbox through the real NELI elector: each shard's
pipeline drains its own keys under its own fence row, in both delivery modes, with shard labels
on the metrics and on the identity headers' epochs."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta
from typing import Any

import psycopg
import pytest
from prometheus_client import generate_latest
from psycopg import sql

from harvester import Harvester, HarvesterConfig, Limits
from harvester.core.identity import Identity
from harvester.core.shards import shard_of
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table
from tests.engine.workload import check, wait_drained, wait_until, write_concurrently
from tests.support.kafka import consumed_headers, delete_topics, read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

SHARDS = 4
COMMITTED = {"isolation.level": "read_committed"}


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_one_harvester_drains_every_shard_through_its_own_pipeline(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    outbox: TableName,
    topics: Callable[..., str],
    delivery: str,
) -> None:
    topic, group = topics(partitions=2), unique("group")
    config = HarvesterConfig(
        data_source=services.pg_dsn,
        outbox_table=outbox.qualified,
        base_kafka_config={"bootstrap.servers": services.bootstrap},
        leader_group_id=group,
        delivery=delivery,  # type: ignore[arg-type]
        shards=SHARDS,
        limits=Limits(heartbeat_timeout=timedelta(seconds=3), mark_query_records=50),
    )
    h = Harvester(config)
    h.start()
    try:
        assert wait_until(lambda: h.leading_shards == list(range(SHARDS)), timeout=60)
        expected = write_concurrently(services.pg_dsn, outbox, topic, keys=120, per_key=10)
        assert wait_drained(services.pg_dsn, outbox) == 0
        per_shard = [m.purged._value.get() for m in h.shard_metrics]
        assert sum(per_shard) == 1200 and all(per_shard), per_shard
        exposed = generate_latest(h.registry).decode()
        for shard in range(SHARDS):
            assert f'harvester_records_purged_total{{shard="{shard}"}}' in exposed
        backlog = [line for line in exposed.splitlines() if line.startswith("harvester_outbox_backlog_records")]
        assert len(backlog) == 1 and "{" not in backlog[0], backlog  # the whole outbox, unlabelled
    finally:
        h.stop(timeout=10)
        delete_topics(services.bootstrap, [f"{group}.neli", f"{group}.checkpoints"])
    fence = pg.execute(
        sql.SQL("SELECT shard, shards, epoch FROM {} WHERE outbox_table = %s ORDER BY shard").format(
            fence_table(outbox).ident
        ),
        (outbox.qualified,),
    ).fetchall()
    assert [(r[0], r[1]) for r in fence] == [(s, SHARDS) for s in range(SHARDS)]
    epochs = {int(str(r[0])): int(str(r[2])) for r in fence}
    assert len(set(epochs.values())) == SHARDS  # every shard's term has an epoch of its own
    isolation: dict[str, Any] = COMMITTED if delivery == "exactly_once" else {"isolation.level": "read_uncommitted"}
    got = read_messages(services.bootstrap, [topic], 1200, **isolation)
    verdict = check(got, expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    if delivery == "exactly_once":
        assert verdict.duplicates == 0
    for message in got:
        identity = Identity.from_headers(consumed_headers(message))
        assert identity is not None
        key = (message.key() or b"").decode()
        assert identity.epoch == epochs[shard_of(key, SHARDS)]  # published by its key's shard

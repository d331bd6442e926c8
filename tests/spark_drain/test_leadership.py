"""A Spark drain in the reapers' leader group: it harvests only the shards it leads, and a reaper
joining the group takes shards from it without the two ever harvesting one shard at once; the
drain's records published by the ``outbox-publish`` sink, or by the source's tasks (``publish``)."""

from __future__ import annotations

import threading
from collections import defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harvester import OutboxRecord, Stasher
from harvester.core.identity import Identity
from harvester.core.shards import shard_of
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table
from tests.engine.workload import check, wait_drained, wait_until
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.shards.test_rebalance import leading
from tests.spark_drain.conftest import Drain
from tests.support.kafka import consumed_headers, delete_topics, read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

SHARDS = 2


def write_until(dsn: str, table: TableName, topic: str, written: dict[str, int], stop: threading.Event) -> None:
    """One record of every key of ``written`` per transaction, two transactions a second (a rate
    the drain keeps up with on a loaded machine), until ``stop``; values are ``<key>:<seq>``."""
    stasher = Stasher(table)
    with psycopg.connect(dsn) as conn:
        while not stop.wait(0.5):
            with conn.transaction():
                stasher.stash(conn, [OutboxRecord(topic=topic, key=k, value=f"{k}:{n}") for k, n in written.items()])
            for k in written:
                written[k] += 1


@pytest.mark.parametrize("publisher", ["sink", "source"])
def test_a_reaper_joining_takes_a_shard_from_the_drain_and_no_shard_is_harvested_by_both(
    publisher: str,
    services: Services,
    pg: psycopg.Connection[Any],
    outbox: TableName,
    topics: Callable[..., str],
    drained: Drain,
    tmp_path: Path,
) -> None:
    topic, group = topics(partitions=2), unique("group")
    fence = sql.SQL("SELECT shard, leader_id FROM {} WHERE outbox_table = %s ORDER BY shard").format(
        fence_table(outbox).ident
    )
    stream = drained(
        shards=str(SHARDS),
        maxRecordsPerTrigger="400",
        leaderGroupID=group,
        **{"kafka.bootstrap.servers": services.bootstrap},
        **({"publish": "true"} if publisher == "source" else {}),
    )
    # The project's sink, no column selected, or the source's tasks: either places a key as a reaper
    # does, so the key stays in one partition across the handover.
    sink = (
        stream.writeStream.format("outbox-publish")
        .option("dsn", services.pg_dsn)
        .option("table", outbox.qualified)
        .option("kafka.bootstrap.servers", services.bootstrap)
        if publisher == "sink"
        else stream.writeStream.format("noop")
    )
    query = sink.option("checkpointLocation", str(tmp_path / "cp")).trigger(processingTime="300 milliseconds").start()
    stop, expected = threading.Event(), {f"k{i}": 0 for i in range(20)}
    writer = threading.Thread(target=write_until, args=(services.pg_dsn, outbox, topic, expected, stop))
    reaper: HarvesterProcess | None = None
    try:
        # The drain alone in the group leads both shards: it took both terms.
        assert wait_until(lambda: len(pg.execute(fence, (outbox.qualified,)).fetchall()) == SHARDS, timeout=90)
        writer.start()
        assert wait_until(lambda: min(expected.values()) >= 3)
        spec = harvester_spec(
            services.pg_dsn,
            services.bootstrap,
            outbox,
            group,
            "reaper",
            shards=SHARDS,
            limits={"mark_query_records": 20, "max_in_flight_records": 40},
        )
        reaper = HarvesterProcess(spec)
        # Cooperative-sticky: the joining reaper gets one shard, the drain keeps the other.
        assert wait_until(lambda: len(leading(reaper)) == 1, timeout=90)
        written = sum(expected.values())
        assert wait_until(lambda: sum(expected.values()) >= written + 200, timeout=60)
        stop.set()
        writer.join()
        assert wait_drained(services.pg_dsn, outbox, timeout=120) == 0
        assert query.exception() is None and query.isActive
        (taken,) = leading(reaper)
        held = {int(r[0]): str(r[1]) for r in pg.execute(fence, (outbox.qualified,))}
        reaper_terms = {str(e["leader_id"]) for e in reaper.events if e["event"] == "LeaderAcquired"}
        assert held[taken] in reaper_terms and held[1 - taken] not in reaper_terms  # the drain leads the other
    finally:
        stop.set()
        if writer.is_alive():
            writer.join()
        query.stop()
        exit_line = reaper.terminate() if reaper is not None else None
        delete_topics(services.bootstrap, [f"{group}.neli"])
    assert exit_line is not None and exit_line["fenced_statements"] == 0  # the drain never took its shard

    got = read_messages(services.bootstrap, [topic], sum(expected.values()), timeout=120)
    verdict = check(got, expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    # Never both at once: in each Kafka partition a shard's records come under ever newer epochs
    # (an older holder's record after a newer one's would be a second harvester of the shard), and
    # every epoch is one shard's term.
    shard_of_epoch: dict[int, int] = {}
    last: dict[tuple[int | None, int], int] = {}
    terms: dict[int, set[int]] = defaultdict(set)
    for message in got:
        identity = Identity.from_headers(consumed_headers(message))
        assert identity is not None
        shard = shard_of((message.key() or b"").decode(), SHARDS)
        assert shard_of_epoch.setdefault(identity.epoch, shard) == shard
        where = (message.partition(), shard)
        assert identity.epoch >= last.get(where, 0), f"shard {shard}: epoch {identity.epoch} after {last[where]}"
        last[where] = identity.epoch
        terms[shard].add(identity.epoch)
    assert taken in terms and len(terms[taken]) >= 2  # the moved shard was harvested by the drain, then the reaper

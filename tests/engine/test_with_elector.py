"""The engine under the real NELI elector: two competing harvesters, the leader leaves mid-drain."""

from __future__ import annotations

import threading
from collections.abc import Callable
from datetime import timedelta

import pytest

from harvester import Harvester, HarvesterConfig, Limits
from harvester.core.events import Event, LeaderAcquired
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check, wait_drained, wait_until, write_concurrently
from tests.support.kafka import read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration


def test_two_harvesters_one_leads_and_the_other_takes_over(
    services: Services, outbox: TableName, topics: Callable[..., str]
) -> None:
    topic = topics(partitions=2)
    group = unique("group")
    acquired: dict[str, threading.Event] = {"a": threading.Event(), "b": threading.Event()}

    def make(name: str) -> Harvester:
        def on_event(event: Event) -> None:
            if isinstance(event, LeaderAcquired):
                acquired[name].set()

        config = HarvesterConfig(
            data_source=services.pg_dsn,
            outbox_table=outbox.qualified,
            base_kafka_config={"bootstrap.servers": services.bootstrap},
            leader_group_id=group,
            name=name,
            limits=Limits(heartbeat_timeout=timedelta(seconds=3), mark_query_records=20, max_in_flight_records=20),
        )
        return Harvester(config, on_event=on_event)

    a, b = make("a"), make("b")
    a.start()
    assert acquired["a"].wait(30)
    b.start()
    writer = threading.Thread(
        target=write_concurrently, args=(services.pg_dsn, outbox, topic), kwargs={"keys": 100, "per_key": 20}
    )
    writer.start()
    assert wait_until(lambda: a.metrics.purged._value.get() > 100)
    assert not b.is_leader
    a.stop(timeout=10)  # graceful: drains, leaves the group; b takes over
    assert acquired["b"].wait(15)
    writer.join()
    try:
        assert wait_drained(services.pg_dsn, outbox) == 0
    finally:
        b.stop(timeout=10)
    verdict = check(read_messages(services.bootstrap, [topic], 2000), {f"k{i}": 20 for i in range(100)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    assert verdict.duplicates == 0  # a graceful handover purges everything it published
    assert b.metrics.purged._value.get() > 0

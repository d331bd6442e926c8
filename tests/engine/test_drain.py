"""The engine drains a real outbox into a real broker: nothing lost, per-key order kept."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check, wait_drained, write_concurrently
from tests.support.harvesters import HarvesterFactory
from tests.support.kafka import read_messages
from tests.support.services import Services

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("key_release", ["acknowledged", "purged"])
def test_concurrent_writers_many_keys_all_delivered_in_key_order(
    services: Services,
    outbox: TableName,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
    key_release: str,
) -> None:
    topic = topics(partitions=4)
    h = make_harvester(max_in_flight_records=200, settings={"key_release": key_release})
    expected = write_concurrently(services.pg_dsn, outbox, topic, keys=300, per_key=10, writers=8)
    assert wait_drained(services.pg_dsn, outbox) == 0
    total = sum(expected.values())
    verdict = check(read_messages(services.bootstrap, [topic], total), expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    assert verdict.duplicates == 0  # no failure happened, so nothing may be published twice
    assert h.in_flight_records == 0


def test_hot_keys_keep_order_under_throttle(
    services: Services, outbox: TableName, topics: Callable[..., str], make_harvester: HarvesterFactory
) -> None:
    topic = topics()
    make_harvester(max_in_flight_records=5, mark_query_records=50)
    expected = write_concurrently(services.pg_dsn, outbox, topic, keys=3, per_key=200, writers=3, per_txn=10)
    assert wait_drained(services.pg_dsn, outbox) == 0
    verdict = check(read_messages(services.bootstrap, [topic], 600), expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.duplicates == 0

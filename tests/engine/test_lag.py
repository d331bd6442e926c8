"""The lag gauge (``harvester_outbox_lag_seconds``) of the polling source: the age of the oldest
record committed and not yet acknowledged by Kafka, from its ``create_time``, growing while the
drain is stalled (a producer whose broker never answers), for an outbox of one shard or several.
The log source's are in tests/log/test_lag.py."""

from __future__ import annotations

from collections.abc import Callable
from datetime import timedelta

import psycopg
import pytest
from prometheus_client import generate_latest
from psycopg import sql

from harvester import Harvester, HarvesterConfig, Limits
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import wait_until
from tests.support.kafka import delete_topics
from tests.support.names import unique
from tests.support.ports import free_ports
from tests.support.services import Services


def lag(h: Harvester) -> float:
    return float(h.shard_metrics[0].lag._value.get())


@pytest.mark.integration
@pytest.mark.parametrize("shards", [1, 2])
def test_the_lag_of_a_stalled_drain_grows_from_create_time(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    outbox: TableName,
    topics: Callable[..., str],
    shards: int,
) -> None:
    topic, group = topics(), unique("lag")
    # Committed an hour ago, as create_time says; never acknowledged: nothing listens on that port.
    pg.execute(
        sql.SQL(
            "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value)"
            " SELECT now() - interval '1 hour', %s, 'k' || i, 'v' FROM generate_series(1, 4) i"
        ).format(outbox.ident),
        (topic,),
    )
    config = HarvesterConfig(
        data_source=services.pg_dsn,
        outbox_table=outbox.qualified,
        base_kafka_config={"bootstrap.servers": services.bootstrap},
        producer_kafka_config={"bootstrap.servers": f"127.0.0.1:{free_ports(1)}", "log_level": 0},
        leader_group_id=group,
        shards=shards,
        limits=Limits(min_metrics_interval=timedelta(milliseconds=100), heartbeat_timeout=timedelta(seconds=3)),
    )
    h = Harvester(config)
    h.start()
    try:
        assert wait_until(lambda: h.leading_shards == list(range(shards)), timeout=60)
        assert wait_until(lambda: h.in_flight_records > 0, timeout=30)
        assert wait_until(lambda: lag(h) >= 3600, timeout=30)
        first = lag(h)
        assert wait_until(lambda: lag(h) > first, timeout=30)  # the record still waits: the lag grows
        lines = generate_latest(h.registry).decode().splitlines()
        exposed = [line for line in lines if line.startswith("harvester_outbox_lag")]
        assert len(exposed) == 1 and "{" not in exposed[0], exposed  # the whole outbox's, without a shard label
    finally:
        h.stop(timeout=1)  # its records cannot be acknowledged: no use waiting for them
        delete_topics(services.bootstrap, [f"{group}.neli"])

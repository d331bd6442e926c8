"""The lag gauge (``harvester_outbox_lag_seconds``) of the log source, in each variant (rows deleted
per batch, a retention window, the table-less outbox): the age of the oldest record committed and
not yet acknowledged by Kafka grows while the drain is stalled (a producer whose broker never
answers), and, where the table cannot tell (the retention window keeps delivered rows, the
table-less outbox has none), the backlog and the oldest record's age come from the leader's
transactions instead of being left at 0."""

from __future__ import annotations

from collections.abc import Iterator
from datetime import timedelta

import psycopg
import pytest
from psycopg import sql
from pydantic import ByteSize

from harvester import Harvester, HarvesterConfig, Limits
from harvester.postgres.identifiers import TableName
from tests.engine.workload import wait_until
from tests.log.conftest import stash
from tests.support import HarvesterFactory, Services, free_ports, harvesters, unique

pytestmark = pytest.mark.integration


@pytest.fixture(params=["log", "retention", "tableless"])
def variant(request: pytest.FixtureRequest) -> tuple[str, TableName]:
    """The variant and its outbox (a table with its slot, or the table-less outbox's slot)."""
    outbox = request.getfixturevalue("message_outbox" if request.param == "tableless" else "log_outbox")
    return request.param, outbox


@pytest.fixture
def make_stalled(services: Services, logical_dsn: str, variant: tuple[str, TableName]) -> Iterator[HarvesterFactory]:
    """Log-source harvesters of the variant whose producer's broker never answers."""
    kind, outbox = variant

    def config() -> HarvesterConfig:
        return HarvesterConfig(
            data_source=logical_dsn,
            outbox_table=outbox.qualified,
            source="log",
            log_messages=kind == "tableless",
            log_retention=timedelta(seconds=60) if kind == "retention" else timedelta(0),
            log_transaction_memory=ByteSize(1 << 26),
            base_kafka_config={"bootstrap.servers": services.bootstrap},
            producer_kafka_config={"bootstrap.servers": f"127.0.0.1:{free_ports(1)}", "log_level": 0},
            limits=Limits(min_metrics_interval=timedelta(milliseconds=100), io_error_backoff=timedelta(seconds=0.1)),
        )

    with harvesters(config) as make:
        yield make


def gauges(h: Harvester) -> tuple[float, float, float]:
    """(lag, backlog, oldest record's age) as the meter sampled them last."""
    m = h.shard_metrics[0]
    return float(m.lag._value.get()), float(m.backlog._value.get()), float(m.oldest_age._value.get())


def test_the_lag_of_a_stalled_drain_grows_from_commit_time(
    logical_dsn: str, variant: tuple[str, TableName], make_stalled: HarvesterFactory
) -> None:
    kind, outbox = variant
    h = make_stalled()
    topic = unique("topic")
    if kind == "tableless":
        stash(logical_dsn, outbox, [(topic, f"k{i}", "v") for i in range(4)])
    else:
        with psycopg.connect(logical_dsn, autocommit=True) as conn:
            conn.execute(
                sql.SQL(
                    "INSERT INTO {} (kafka_topic, kafka_key, kafka_value) SELECT %s, 'k' || i, 'v'"
                    " FROM generate_series(1, 4) i"
                ).format(outbox.ident),
                (topic,),
            )
    assert wait_until(lambda: h.in_flight_records > 0, timeout=30)
    assert wait_until(lambda: gauges(h)[0] >= 1.0, timeout=30)
    first = gauges(h)[0]
    assert wait_until(lambda: gauges(h)[0] > first, timeout=30)  # nothing acknowledged: the lag grows
    lag, backlog, oldest = gauges(h)
    # Where the table counts delivered rows too, or there is none, from the leader's transactions.
    assert backlog == 4 and oldest > 0, (lag, backlog, oldest)
    h.stop(timeout=1)  # its records cannot be acknowledged: no use waiting for them

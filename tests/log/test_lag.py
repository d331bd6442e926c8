"""The lag gauge (``harvester_outbox_lag_seconds``) of the log source, in each variant (rows deleted
per batch, a retention window, the table-less outbox): the age of the oldest record committed and
not yet acknowledged by Kafka grows while the drain is stalled (a producer whose broker never
answers), and, where the table cannot tell (the retention window keeps delivered rows, the
table-less outbox has none), the backlog and the oldest record's age come from the leader's
transactions instead of being left at 0; ``reaper status`` shows a table-less outbox's lag as its
leader's heartbeats carry it."""

from __future__ import annotations

import json
from collections.abc import Iterator
from datetime import timedelta
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql
from pydantic import ByteSize

from harvester import Harvester, HarvesterConfig, Limits
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import wait_until
from tests.log.conftest import stash
from tests.reaper.test_e2e import wait_for
from tests.reaper.test_http_port import Process
from tests.support.harvesters import HarvesterFactory, harvesters
from tests.support.kafka import delete_topics
from tests.support.names import unique
from tests.support.ports import free_ports
from tests.support.reaper import run_reaper
from tests.support.services import Services

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
            log_accept_loss_on_failover=kind == "tableless",  # a single server (tests/log/conftest.py)
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
    lag, backlog, oldest = (
        float(h.registry.get_sample_value(f"harvester_outbox_{name}") or 0.0)
        for name in ("lag_seconds", "backlog_records", "oldest_record_age_seconds")
    )
    return lag, backlog, oldest


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
    # The slot is not confirmed past them: it retains their WAL (LogStore.sample, by the meter).
    assert (h.registry.get_sample_value("harvester_log_slot_retained_bytes") or 0) > 0
    h.stop(timeout=1)  # its records cannot be acknowledged: no use waiting for them


def test_status_shows_the_lag_of_a_stalled_table_less_outbox_from_the_leaders_heartbeats(
    services: Services, logical_dsn: str, message_outbox: TableName, tmp_path: Path
) -> None:
    # No table to read the lag from: the leader's meter samples it, its heartbeats carry it.
    group = unique("lag-status")
    config = tmp_path / "reaper.yaml"
    config.write_text(f"""\
harvest:
  dataSource: '{logical_dsn}'
  outboxTable: {message_outbox}
  source: log
  logMessages: true
  logAcceptLossOnFailover: true
  leaderGroupID: {group}
  leaderTopic: {group}.neli
  baseKafkaConfig:
    bootstrap.servers: {services.bootstrap}
  producerKafkaConfig:
    bootstrap.servers: 127.0.0.1:{free_ports(1)}
  limits:
    minMetricsInterval: 200ms
""")
    reaper = Process(config, "lag", tmp_path)
    try:
        # Polled on its metrics endpoint: a `reaper status` process costs seconds to start.
        wait_for("the reaper to lead", lambda: bool(reaper.events("reaper_started")) and reaper.leads(), 90)
        stash(logical_dsn, message_outbox, [(unique("topic"), "k", "v")])
        wait_for("the leader's own lag gauge to pass a second", lambda: lag_gauge(reaper) >= 1.0, 60)

        def lag() -> float:
            done = run_reaper("status", "-f", str(config), "--json")
            assert done.returncode == 0, done.stderr
            value = json.loads(done.stdout)["lag_seconds"]
            return float(value) if value is not None else 0.0

        # Its next heartbeat carries that sample (or a later, larger one): status shows it.
        wait_for("status to show a lag past a second", lambda: lag() >= 1.0, 60)
        text = run_reaper("status", "-f", str(config)).stdout
        assert "lag: " in text and "(the oldest record committed and not acknowledged by Kafka)" in text, text
    finally:
        reaper.kill()
        delete_topics(services.bootstrap, [f"{group}.neli"])


def lag_gauge(reaper: Process) -> float:
    """``harvester_outbox_lag_seconds`` on the reaper's metrics endpoint (0 before it answers)."""
    status, body = reaper.get("/metrics")
    if status != 200 or not isinstance(body, str):
        return 0.0
    samples = (s for f in text_string_to_metric_families(body) for s in f.samples)
    return next((s.value for s in samples if s.name == "harvester_outbox_lag_seconds"), 0.0)

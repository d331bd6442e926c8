"""The meter's sample: what a store's :class:`SourceGauges` reports reaches the gauges and the
``MeterRead`` event, with every shard's counters summed (read through prometheus-client's public API)."""

from __future__ import annotations

import queue
import threading

import pytest

from harvester.core.events import Event, MeterRead
from harvester.core.meter import HeadGauges, Meter
from harvester.core.metrics import HarvesterMetrics, total
from harvester.core.protocols import SourceGauges, SourceSample

pytestmark = pytest.mark.unit


class Slot:
    def sample(self, leads: bool) -> SourceSample:
        return SourceSample(backlog=7, oldest_age=1.5, lag=2.5, slot_bytes=(100, 300))


class Table:
    def head(self) -> tuple[int, float | None]:
        return 3, None


def first_read(gauges: SourceGauges, shards: list[HarvesterMetrics]) -> MeterRead:
    events: queue.Queue[Event] = queue.Queue()
    stopped = threading.Event()
    meter = Meter(gauges, shards, list, events.put, 0.001, stopped)
    meter.start()
    try:
        event = events.get(timeout=30)
    finally:
        stopped.set()
    assert isinstance(event, MeterRead)
    return event


def test_source_gauges_and_counters_of_every_shard() -> None:
    shards = [HarvesterMetrics(), HarvesterMetrics()]
    shards[0].published.inc(4)
    shards[1].published.inc(5)
    shards[1].purged.inc(2)
    stats = first_read(Slot(), shards).stats
    assert (stats["backlog"], stats["oldest_age_seconds"], stats["lag_seconds"]) == (7.0, 1.5, 2.5)
    assert (stats["published"], stats["purged"], stats["reset"]) == (9.0, 2.0, 0.0)
    outbox = shards[0].registry
    assert outbox.get_sample_value("harvester_log_slot_lag_bytes") == 100
    assert outbox.get_sample_value("harvester_log_slot_retained_bytes") == 300
    assert outbox.get_sample_value("harvester_outbox_lag_seconds") == 2.5


def test_a_store_without_gauges_is_sampled_by_its_head() -> None:
    shards = [HarvesterMetrics()]
    stats = first_read(HeadGauges(Table()), shards).stats
    assert (stats["backlog"], stats["oldest_age_seconds"], stats["lag_seconds"]) == (3.0, 0.0, 0.0)
    assert shards[0].registry.get_sample_value("harvester_log_slot_lag_bytes") == 0


def test_total_sums_a_counters_labels() -> None:
    metrics = HarvesterMetrics()
    metrics.retries.labels("transient").inc(2)
    metrics.retries.labels("permanent").inc()
    assert total(metrics.retries) == 3

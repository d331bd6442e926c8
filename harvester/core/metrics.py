"""Prometheus metrics of one harvester, in a registry of its own (several may share a process).

A sharded harvester keeps one set per shard, each in a private registry, and exports them through
:class:`ShardLabels`: the same series with a ``shard`` label. An outbox of one shard exports its
series without the label, as before sharding existed.
"""

from __future__ import annotations

import threading
from bisect import bisect_left
from collections.abc import Iterable, Iterator, Sequence

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram
from prometheus_client.metrics_core import HistogramMetricFamily, Metric
from prometheus_client.registry import Collector

# Series about the whole outbox (sampled by the meter thread, which shard 0's set holds): exported
# once, without a shard label, so that a sum over shards still means something.
OUTBOX_WIDE = (
    "harvester_outbox_backlog_records",
    "harvester_outbox_oldest_record_age_seconds",
    "harvester_outbox_lag_seconds",
)

_LATENCY_BUCKETS = (0.001, 0.0025, 0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1, 2.5, 5, 10, 30, 60)


class BatchHistogram(Collector):
    """A histogram observed a batch at a time: the publish latency is observed once per delivered
    record, and ``Histogram.observe`` (a lock and a bucket scan per call) cost about 5% of the
    relay's CPU per record at full speed."""

    def __init__(self, name: str, documentation: str, buckets: Sequence[float], registry: CollectorRegistry) -> None:
        self._name, self._documentation = name, documentation
        self._bounds = tuple(buckets)  # +Inf is the count
        self._counts = [0] * (len(self._bounds) + 1)
        self._sum = 0.0
        self._lock = threading.Lock()
        registry.register(self)

    def observe_many(self, runs: Iterable[tuple[float, int]]) -> None:
        """Observe each value of ``runs`` as many times as it says."""
        bounds, counts, total = self._bounds, [0] * (len(self._bounds) + 1), 0.0
        for value, times in runs:
            counts[bisect_left(bounds, value)] += times  # a bucket counts values <= its bound
            total += value * times
        with self._lock:
            self._counts = [a + b for a, b in zip(self._counts, counts, strict=True)]
            self._sum += total

    def collect(self) -> Iterator[Metric]:
        with self._lock:
            counts, total = self._counts, self._sum
        cumulative, buckets = 0, []
        for bound, count in zip((*self._bounds, float("inf")), counts, strict=True):
            cumulative += count
            buckets.append(("+Inf" if bound == float("inf") else repr(float(bound)), float(cumulative)))
        yield HistogramMetricFamily(self._name, self._documentation, buckets=buckets, sum_value=total)


class HarvesterMetrics:
    """The series a harvester exports; all names start with ``harvester_``."""

    def __init__(self, registry: CollectorRegistry | None = None) -> None:
        self.registry = registry if registry is not None else CollectorRegistry()
        r = self.registry
        self.published = Counter("harvester_records_published", "Records handed to Kafka.", registry=r)
        self.purged = Counter("harvester_records_purged", "Records acknowledged and deleted.", registry=r)
        self.reset = Counter("harvester_records_reset", "Records whose delivery failed and were unmarked.", registry=r)
        self.dead_lettered = Counter(
            "harvester_records_dead_lettered", "Records moved to the dead-letter table.", ["reason"], registry=r
        )
        self.retries = Counter(
            "harvester_retries", "Failed deliveries that will be retried, by class.", ["class"], registry=r
        )
        self.store_retries = Counter(
            "harvester_store_retries",
            "Failed store statements that will be retried, by operation (mark, purge, dead_letter, ...).",
            ["operation"],
            registry=r,
        )
        self.stalled_seconds = Gauge(
            "harvester_stalled_seconds",
            "How long a store operation has failed without a success, once that reaches stall_timeout (0: none).",
            registry=r,
        )
        self.remarks = Counter("harvester_forced_remarks", "Forced remarks (leader id refreshed).", registry=r)
        self.fenced = Counter("harvester_leader_fenced", "Times this instance was fenced.", registry=r)
        self.fenced_statements = Counter(
            "harvester_fenced_statements", "Outbox statements refused by the epoch fence.", registry=r
        )
        self.epoch = Gauge("harvester_epoch", "Fence epoch of the current leadership term (0: none).", registry=r)
        self.transactions_committed = Counter(
            "harvester_transactions_committed", "Kafka transactions committed (exactly-once mode).", registry=r
        )
        self.transactions_aborted = Counter(
            "harvester_transactions_aborted", "Kafka transactions aborted (exactly-once mode).", registry=r
        )
        self.recoveries = Counter(
            "harvester_checkpoint_recoveries", "Checkpoint recoveries by a new leader (exactly-once mode).", registry=r
        )
        self.recovery_seconds = Histogram(
            "harvester_checkpoint_recovery_seconds", "Duration of checkpoint recoveries.", registry=r
        )
        self.in_flight = Gauge("harvester_in_flight_records", "Records published, not yet acknowledged.", registry=r)
        self.queued = Gauge("harvester_queued_records", "Marked records waiting behind a busy key.", registry=r)
        self.is_leader = Gauge("harvester_is_leader", "1 while this instance leads.", registry=r)
        self.mark_seconds = Histogram(
            "harvester_mark_query_seconds", "Duration of mark queries.", buckets=_LATENCY_BUCKETS, registry=r
        )
        self.publish_latency = BatchHistogram(
            "harvester_publish_latency_seconds",
            "Time from a record's create_time to its delivery acknowledgement.",
            _LATENCY_BUCKETS,
            r,
        )
        self.backlog = Gauge("harvester_outbox_backlog_records", "Outbox records (id span, sampled).", registry=r)
        self.slot_lag = Gauge(
            "harvester_log_slot_lag_bytes", "WAL bytes the log source's slot has not consumed (sampled).", registry=r
        )
        self.slot_retained = Gauge(
            "harvester_log_slot_retained_bytes", "WAL bytes the log source's slot retains (sampled).", registry=r
        )
        self.oldest_age = Gauge(
            "harvester_outbox_oldest_record_age_seconds", "Age of the oldest outbox record (sampled).", registry=r
        )
        self.lag = Gauge(
            "harvester_outbox_lag_seconds",
            "Age of the oldest record committed and not yet acknowledged by Kafka (sampled).",
            registry=r,
        )


def total(counter: Counter) -> float:
    """A counter's value (the sum over its labels), read through the public ``collect``."""
    return sum(s.value for family in counter.collect() for s in family.samples if s.name.endswith("_total"))


class ShardLabels(Collector):
    """Exports several shards' :class:`HarvesterMetrics` as one set of series labelled ``shard``."""

    def __init__(self, shards: Sequence[HarvesterMetrics]) -> None:
        self._shards = list(shards)

    def collect(self) -> Iterator[Metric]:
        merged: dict[str, Metric] = {}
        for shard, metrics in enumerate(self._shards):
            for family in metrics.registry.collect():
                if family.name in OUTBOX_WIDE:
                    if shard == 0:
                        yield family
                    continue
                out = merged.get(family.name)
                if out is None:
                    out = merged[family.name] = Metric(family.name, family.documentation, family.type, family.unit)
                for sample in family.samples:
                    labels = {"shard": str(shard), **sample.labels}
                    out.add_sample(sample.name, labels, sample.value, sample.timestamp, sample.exemplar)
        yield from merged.values()

"""A harvester's meter thread: every ``min_metrics_interval`` it samples the whole outbox's backlog
and lag (and what its source knows besides, such as the log source's slot) into the metrics, and
reports the harvester's counters in a :class:`~harvester.core.events.MeterRead` event. The sample
doubles as a standby's probe of its database (:meth:`~harvester.core.engine.Engine.probed`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from harvester.core.engine import Engine
from harvester.core.events import Event, MeterRead
from harvester.core.metrics import HarvesterMetrics, total
from harvester.core.protocols import Backlog, SourceGauges, SourceSample, StoreError


class HeadGauges:
    """The :class:`SourceGauges` of a store that knows only its head (the table is the backlog)."""

    def __init__(self, store: Backlog) -> None:
        self._store = store

    def sample(self, leads: bool) -> SourceSample:
        backlog, age = self._store.head()
        return SourceSample(backlog, age, age or 0.0)


class Meter:
    """Samples through ``gauges`` (of any shard's store: the backlog is the whole outbox's) into
    ``metrics`` (the series about the whole outbox are shard 0's) until ``stopped`` is set."""

    def __init__(
        self,
        gauges: SourceGauges,
        metrics: Sequence[HarvesterMetrics],
        engines: Callable[[], list[Engine]],
        emit: Callable[[Event], None],
        interval: float,
        stopped: threading.Event,
    ) -> None:
        self._gauges = gauges
        self._metrics = list(metrics)
        self._engines = engines
        self._emit = emit
        self._interval = interval
        self._stopped = stopped
        self.lag: float | None = None  # the last sample's lag in seconds (None: none taken yet)
        self._thread = threading.Thread(target=self._run, name="harvester-meter", daemon=True)

    def start(self) -> None:
        """Start the meter thread."""
        self._thread.start()

    def is_alive(self) -> bool:
        """Whether the meter thread runs."""
        return self._thread.is_alive()

    def _run(self) -> None:
        outbox = self._metrics[0]
        while not self._stopped.wait(self._interval):
            engines = self._engines()
            try:
                sample = self._gauges.sample(any(e.leader_id is not None for e in engines))
            except StoreError as exc:
                self._probed(exc)
                continue
            self._probed(None)
            self.lag = sample.lag
            outbox.backlog.set(sample.backlog)
            outbox.oldest_age.set(sample.oldest_age or 0.0)
            outbox.lag.set(sample.lag)
            if sample.slot_bytes is not None:
                outbox.slot_lag.set(sample.slot_bytes[0])
                outbox.slot_retained.set(sample.slot_bytes[1])
            shards = self._metrics
            stats = {
                "backlog": float(sample.backlog),
                "oldest_age_seconds": sample.oldest_age or 0.0,
                "lag_seconds": sample.lag,
                "in_flight_records": float(sum(e.in_flight_records for e in engines)),
                "queued_records": float(sum(e.queued_records for e in engines)),
                "published": sum(total(m.published) for m in shards),
                "purged": sum(total(m.purged) for m in shards),
                "reset": sum(total(m.reset) for m in shards),
            }
            self._emit(MeterRead(stats))

    def _probed(self, error: StoreError | None) -> None:
        for engine in self._engines():
            engine.probed(error, self._interval)

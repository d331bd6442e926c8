"""A harvester's meter thread: every ``min_metrics_interval`` it samples the whole outbox's backlog
and lag (and the log source's slot) into the metrics, and reports the harvester's counters in a
:class:`~harvester.core.events.MeterRead` event. The sample doubles as a standby's probe of its
database (:meth:`~harvester.core.engine.Engine.probed`)."""

from __future__ import annotations

import threading
from collections.abc import Callable, Sequence

from harvester.core.engine import Engine
from harvester.core.events import Event, MeterRead
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import StoreError
from harvester.postgres.log_position import PositionedLogStore
from harvester.postgres.log_store import LogStore
from harvester.postgres.store import PostgresStore


class Meter:
    """Samples through ``store`` (any shard's: the backlog is the whole outbox's) into ``metrics``
    (the series about the whole outbox are shard 0's) until ``stopped`` is set."""

    def __init__(
        self,
        store: PostgresStore,
        metrics: Sequence[HarvesterMetrics],
        engines: Callable[[], list[Engine]],
        emit: Callable[[Event], None],
        interval: float,
        stopped: threading.Event,
    ) -> None:
        self._store = store
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
            try:
                backlog, age = self._store.head()
            except StoreError as exc:
                self._probed(exc)
                continue
            self._probed(None)
            engines = self._engines()
            # What a log store received is its leader's to count: a former leader's is stale.
            leads = any(e.leader_id is not None for e in engines)
            if isinstance(self._store, PositionedLogStore) and not leads:
                backlog, age = 0, None
            lag = age or 0.0
            if isinstance(self._store, LogStore) and leads:
                lag = max(lag, self._store.received_age() or 0.0)
            self.lag = lag
            outbox.backlog.set(backlog)
            outbox.oldest_age.set(age or 0.0)
            outbox.lag.set(lag)
            if isinstance(self._store, LogStore):
                try:
                    slot = self._store.slot_bytes()
                except StoreError:
                    slot = None
                if slot is not None:
                    outbox.slot_lag.set(slot[0])
                    outbox.slot_retained.set(slot[1])
            shards = self._metrics
            stats = {
                "backlog": float(backlog),
                "oldest_age_seconds": age or 0.0,
                "lag_seconds": lag,
                "in_flight_records": float(sum(e.in_flight_records for e in engines)),
                "queued_records": float(sum(e.queued_records for e in engines)),
                "published": sum(m.published._value.get() for m in shards),
                "purged": sum(m.purged._value.get() for m in shards),
                "reset": sum(m.reset._value.get() for m in shards),
            }
            self._emit(MeterRead(stats))

    def _probed(self, error: StoreError | None) -> None:
        for engine in self._engines():
            engine.probed(error, self._interval)

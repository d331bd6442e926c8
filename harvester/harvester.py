"""The embeddable harvester: runs the store, publishers, elector and MP/R engines that
:mod:`harvester.compose` builds from a config.

With ``shards: N`` > 1 the harvester holds one pipeline per shard (store, publisher, engine,
metrics), each independent of the others: the elector's events for shard ``i`` drive pipeline ``i``
only. The pipelines are threads of this process (docs/sharding.md says what that costs).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Any
from uuid import UUID

import structlog
from prometheus_client import CollectorRegistry

from harvester.compose import Pipeline, build_engine, neli_elector, raised_max_poll_interval, reachable, source
from harvester.config import HarvesterConfig
from harvester.core.engine import Engine
from harvester.core.events import Event, MeterRead
from harvester.core.meter import Meter
from harvester.core.metrics import HarvesterMetrics, ShardLabels
from harvester.core.protocols import Elector, ShardedElector
from harvester.core.retries import Stall

if TYPE_CHECKING:
    from leader.events import LeaderEvent

log = structlog.get_logger("harvester")

_STOP_RESERVE = 2.0
"""Seconds of a stop's budget kept from the drain for leaving the group and closing the producer."""


class Harvester:
    """Drains one outbox table into Kafka while this process is leader of its group.

    ``start()`` returns at once; work happens on background threads. ``stop()`` stops marking,
    waits (bounded) for in-flight records to be acknowledged and purged, and leaves the group so a
    standby takes over. Records still unacknowledged are simply marked again by the next leader.
    """

    def __init__(
        self,
        config: HarvesterConfig,
        *,
        on_event: Callable[[Event], None] | None = None,
        registry: CollectorRegistry | None = None,
        elector: Elector | None = None,
        labels: Mapping[str, str] | None = None,
    ) -> None:
        self.config = config
        # Bound to every log line of this harvester (``outbox`` when a reaper harvests several).
        self._labels = dict(labels or {})
        self._log = log.bind(**self._labels)
        shards = config.shards
        self._registry = registry if registry is not None else CollectorRegistry()
        # One shard exports its series as they always were; several, each in a private registry
        # exported with a shard label.
        per_shard = [HarvesterMetrics(self._registry if shards == 1 else None) for _ in range(shards)]
        if shards > 1:
            self._registry.register(ShardLabels(per_shard))
        self.metrics = per_shard[0]
        self._shard_metrics = per_shard
        self._on_event = on_event
        built = source(config)
        self._pipelines = [Pipeline(built.store, per_shard[0])]  # the other shards' are built by start()
        for collector in built.collectors:  # one shard: its registry is the harvester's
            self._registry.register(collector)
        self._elector = (
            elector if elector is not None else neli_elector(config, self._heartbeat_report, self.database_reachable)
        )
        raised = raised_max_poll_interval(config)
        if elector is None and raised is not None:
            self._log.warning(
                "max_poll_interval_raised",
                configured_seconds=config.limits.max_poll_interval.total_seconds(),
                used_seconds=raised,
                hint="maxPollInterval is at least the election's session timeout (librdkafka's rule); "
                "set it to 10s or more, or leave it out (5m), to silence this",
            )
        if shards > 1 and not isinstance(self._elector, ShardedElector):
            raise ValueError(f"shards: {shards} needs an elector of several shards (status_of), such as NeliElector")
        self._failure: str | None = None
        self._started = threading.Event()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        interval = config.limits.min_metrics_interval.total_seconds()
        self._meter = Meter(built.gauges, per_shard, lambda: self._engines, self._emit_event, interval, self._stopped)

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry holding this harvester's series."""
        return self._registry

    @property
    def shard_metrics(self) -> list[HarvesterMetrics]:
        """Each shard's metrics, by shard (one item when the outbox is not sharded)."""
        return list(self._shard_metrics)

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Check the outbox table, then start competing for leadership and harvesting.

        Raises :class:`harvester.core.protocols.ShardCountError` when the outbox's fence records
        another number of shards, besides the errors of a missing table or an unreachable service."""
        first = self._pipelines[0].store
        columns = first.prepare()  # fails fast on a missing or unsupported table, or on another N
        if not columns.tracks_attempts:
            self._log.warning("attempts_in_memory", hint="run 'reaper migrate' so attempt counts survive failover")
        cfg = self.config
        self._pipelines += [
            Pipeline(first.sibling(i), metrics) for i, metrics in enumerate(self._shard_metrics[1:], start=1)
        ]
        for shard, pipeline in enumerate(self._pipelines):
            pipeline.engine = build_engine(
                cfg,
                pipeline,
                shard,
                emit=self._emit_event,
                still_leader=self._leader_check(shard),
                labels=self._labels,
                on_fatal=self._fatal,
            )
        for pipeline in self._pipelines:
            assert pipeline.engine is not None
            pipeline.engine.start()
        self._elector.start(self._on_leader_event)
        self._meter.start()
        self._started.set()
        self._log.info(
            "harvester_started", table=cfg.table.qualified, group=cfg.group_id, topic=cfg.topic, shards=cfg.shards
        )

    def _leader_check(self, shard: int) -> Callable[[], bool]:
        elector = self._elector
        if isinstance(elector, ShardedElector) and self.config.shards > 1:
            return lambda: elector.status_of(shard).is_leader
        return lambda: elector.status.is_leader

    def _on_leader_event(self, event: LeaderEvent) -> None:
        engine = self._pipelines[event.shard].engine if event.shard < len(self._pipelines) else None
        if engine is not None:
            engine.on_leader_event(event)

    def _fatal(self, error: Exception) -> None:
        """A pipeline cannot go on (the group disagrees on the number of shards, a table-less
        outbox's slot was lost): stop everything;
        :attr:`failure` says why."""
        if self._failure is None:
            self._failure = str(error)
            threading.Thread(target=self.stop, name="harvester-fatal-stop", daemon=True).start()

    @property
    def failure(self) -> str | None:
        """Why the harvester stopped by itself, or None."""
        return self._failure

    def stop(self, timeout: float | None = None) -> None:
        """Stop gracefully: finish in-flight work, leave the group, close the producers, all within
        ``timeout`` (default ``drain_interval``). The wait for in-flight records leaves a reserve for
        the rest; records not purged by then stay in the outbox, and the next leader marks them again."""
        if self._stopped.is_set() or self._stopping.is_set():
            self._stopped.wait(None if timeout is None else timeout + 5)
            return
        self._stopping.set()
        budget = self.config.limits.drain_interval.total_seconds() if timeout is None else timeout
        deadline = time.monotonic() + budget
        drained_by = deadline - min(_STOP_RESERVE, budget / 4)
        engines = [p.engine for p in self._pipelines if p.engine is not None]
        for engine in engines:
            engine.stop_marking()
        for engine in engines:
            if not engine.drain(max(0.0, drained_by - time.monotonic())):
                self._log.warning("stop_drain_timeout", in_flight=engine.in_flight_records)
        # Leaving the group may wait out a pending group request: bounded by what the stop has
        # left, but long enough for the revocation's handler, which runs first.
        self._elector.close(max(_STOP_RESERVE, deadline - time.monotonic()))
        for engine in engines:
            engine.close(max(0.0, deadline - time.monotonic()))
        for pipeline in self._pipelines:
            pipeline.store.close()
        self._stopped.set()
        if self._started.is_set():  # a failed start is reported by whoever called start()
            self._log.info("harvester_stopped")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop` completed (True) or ``timeout`` passed (False)."""
        return self._stopped.wait(timeout)

    # ------------------------------------------------------------------ state

    @property
    def _engines(self) -> list[Engine]:
        return [p.engine for p in self._pipelines if p.engine is not None]

    @property
    def alive(self) -> bool:
        """False when one of the harvester's threads died while it should run, or when it is
        :attr:`stalled`: such a process harvests no more and should be restarted (or looked at)."""
        return self.threads_alive and self.stalled is None

    @property
    def threads_alive(self) -> bool:
        """False when one of the harvester's threads (marking, completion, election, metering) died
        while it should run."""
        engines = self._engines
        if not engines or not self._started.is_set() or self._stopping.is_set():
            return True
        return all(e.alive for e in engines) and self._elector.running and self._meter.is_alive()

    @property
    def stalled(self) -> Stall | None:
        """A store statement that has failed without a success for ``limits.stall_timeout`` or longer
        (which one, for how long, and why), if any; its records stay in the outbox."""
        if self._stopping.is_set():
            return None
        stalls = [stall for engine in self._engines if (stall := engine.stalled) is not None]
        return max(stalls, key=lambda stall: stall.seconds, default=None)

    @property
    def is_leader(self) -> bool:
        """Whether this instance is harvesting now (some shard of the outbox)."""
        return bool(self.leading_shards)

    @property
    def leading_shards(self) -> list[int]:
        """The shards this instance harvests now."""
        return [shard for shard, p in enumerate(self._pipelines) if p.engine is not None and p.engine.leader_id]

    @property
    def leader_id(self) -> UUID | None:
        """The id this instance marks records with, while leader (of the first shard it leads)."""
        return next((e.leader_id for e in self._engines if e.leader_id is not None), None)

    def database_reachable(self) -> bool:
        """False once every store call of some pipeline has failed to reach the database for longer
        than ``limits.heartbeat_timeout``: the elector then steps down, so that a process whose
        database path works leads (docs/reaper.md, "A leader cut from PostgreSQL")."""
        limit = self.config.limits.heartbeat_timeout.total_seconds()
        return all(engine.unreachable_seconds <= limit for engine in self._engines)

    def _heartbeat_report(self, shard: int) -> Mapping[str, float]:
        """What a shard's heartbeats tell ``reaper status``: the records its leader has marked and
        not yet purged (marks live in the leader's memory, not in the table), and the lag the meter
        sampled last (a log source without per-batch deletes knows it only in the leader's memory)."""
        engine = self._pipelines[shard].engine if shard < len(self._pipelines) else None
        if engine is None:
            return {}
        lag = self._meter.lag
        report: dict[str, float] = {"in_flight": engine.in_flight_records + engine.queued_records}
        return report if lag is None else {**report, "lag_seconds": round(lag, 3)}

    @property
    def in_flight_records(self) -> int:
        """Records published and not yet acknowledged and purged."""
        return sum(e.in_flight_records for e in self._engines)

    @property
    def in_flight_keys(self) -> int:
        """Keys with a record in flight."""
        return sum(e.in_flight_keys for e in self._engines)

    @property
    def queued_records(self) -> int:
        """Marked records waiting behind a busy key."""
        return sum(e.queued_records for e in self._engines)

    def health(self) -> dict[str, Any]:
        """Liveness of the dependencies, for readiness probes (each check bounded to ~2 s)."""
        return {
            **reachable(self.config),
            "is_leader": self.is_leader,
            "running": bool(self._engines) and not self._stopped.is_set(),
            **({"leading_shards": self.leading_shards} if self.config.shards > 1 else {}),
        }

    # ------------------------------------------------------------------ internals

    def _emit_event(self, event: Event) -> None:
        self._log.info(type(event).__name__, **{k: str(v) for k, v in _fields(event).items()})
        if self._on_event is not None:
            self._on_event(event)


def _fields(event: Event) -> dict[str, Any]:
    if isinstance(event, MeterRead):
        return dict(event.stats)
    return {name: getattr(event, name) for name in event.__slots__}

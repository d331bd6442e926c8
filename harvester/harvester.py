"""The embeddable harvester: store + publisher + elector + MP/R engine, wired from a config."""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import TYPE_CHECKING, Any
from uuid import UUID

import psycopg
import structlog
from confluent_kafka.admin import AdminClient
from prometheus_client import CollectorRegistry

from harvester.config import HarvesterConfig
from harvester.core.at_least_once import at_least_once
from harvester.core.dispatch import DispatcherFactory
from harvester.core.engine import Engine
from harvester.core.events import Event, MeterRead
from harvester.core.exactly_once import exactly_once
from harvester.core.identity import IdentityHeaders
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import BatchScope, DeliveryCallback, Elector, StoreError
from harvester.kafka.publisher import KafkaPublisher, producer_config
from harvester.kafka.topics import ensure_topic
from harvester.kafka.transactions import KafkaTransactionalPublisher
from harvester.postgres.store import PostgresStore

if TYPE_CHECKING:
    from leader import ElectorConfig

log = structlog.get_logger("harvester")


def elector_config(config: HarvesterConfig) -> ElectorConfig:
    """The NELI settings ``config`` implies; raises ``pydantic.ValidationError`` when its limits do
    not fit together (no I/O: ``reaper check`` runs it too)."""
    from leader import ElectorConfig

    limits = config.limits
    return ElectorConfig(
        kafka_config=dict(config.base_kafka_config),
        group_id=config.group_id,
        topic=config.topic,
        heartbeat_timeout=limits.heartbeat_timeout.total_seconds(),
        min_poll_interval=limits.min_poll_interval.total_seconds(),
        max_poll_interval=limits.max_poll_interval.total_seconds(),
        name=config.name,
    )


def neli_elector(config: HarvesterConfig) -> Elector:
    """The default elector: Fast NELI over the configured leader group and topic."""
    from leader import NeliElector

    return NeliElector(elector_config(config))


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
    ) -> None:
        self.config = config
        self.metrics = HarvesterMetrics(registry)
        self._on_event = on_event
        self._store = PostgresStore(
            config.data_source,
            config.table,
            application_name=f"outbox-harvester {config.name}"[:63],
            identity=IdentityHeaders(config.identity_header_prefix),
            producer_name=config.producer_name,
            hold_dead_letter_keys=config.dead_letter_policy == "hold_key",
            vacuum_every=config.limits.vacuum_every_records,
        )
        self._elector = elector if elector is not None else neli_elector(config)
        self._engine: Engine | None = None
        self._started = threading.Event()
        self._stopping = threading.Event()
        self._stopped = threading.Event()
        self._meter = threading.Thread(target=self._meter_loop, name="harvester-meter", daemon=True)

    @property
    def registry(self) -> CollectorRegistry:
        """The Prometheus registry holding this harvester's series."""
        return self.metrics.registry

    # ------------------------------------------------------------------ lifecycle

    def start(self) -> None:
        """Check the outbox table, then start competing for leadership and harvesting."""
        columns = self._store.prepare()  # fails fast on a missing or unsupported table
        if not columns.tracks_attempts:
            log.warning("attempts_in_memory", hint="run 'reaper migrate' so attempt counts survive failover")
        cfg = self.config
        elector = self._elector
        self._engine = Engine(
            self._store,
            self._dispatcher(),
            cfg.limits,
            self.metrics,
            self._emit_event,
            listen_notify=cfg.listen_notify,
            still_leader=lambda: elector.status.is_leader,
            **_tracing(),
        )
        self._engine.start()
        self._elector.start(self._engine.on_leader_event)
        self._meter.start()
        self._started.set()
        log.info("harvester_started", table=cfg.table.qualified, group=cfg.group_id, topic=cfg.topic)

    def _dispatcher(self) -> DispatcherFactory:
        """The configured delivery mode's dispatcher, over this harvester's store and Kafka."""
        cfg = self.config
        kafka = producer_config(cfg.base_kafka_config, cfg.producer_kafka_config)
        if cfg.delivery == "exactly_once":
            ensure_topic(cfg.base_kafka_config, cfg.checkpoints)
            transactions = KafkaTransactionalPublisher(kafka, f"{cfg.group_id}.harvester", cfg.checkpoints)
            return exactly_once(self._store, transactions)

        def publisher(callback: DeliveryCallback) -> KafkaPublisher:
            return KafkaPublisher(kafka, callback)

        return at_least_once(self._store, publisher)

    def stop(self, timeout: float | None = None) -> None:
        """Stop gracefully: finish in-flight work (up to ``timeout``), then leave the group."""
        if self._stopped.is_set():
            return
        self._stopping.set()
        budget = self.config.limits.drain_interval.total_seconds() if timeout is None else timeout
        engine = self._engine
        if engine is not None:
            engine.stop_marking()
            if not engine.drain(budget):
                log.warning("stop_drain_timeout", in_flight=engine.in_flight_records)
        self._elector.close()
        if engine is not None:
            engine.close(max(budget, 1.0))
        self._store.close()
        self._stopped.set()
        if self._started.is_set():  # a failed start is reported by whoever called start()
            log.info("harvester_stopped")

    def wait(self, timeout: float | None = None) -> bool:
        """Block until :meth:`stop` completed (True) or ``timeout`` passed (False)."""
        return self._stopped.wait(timeout)

    # ------------------------------------------------------------------ state

    @property
    def alive(self) -> bool:
        """False when one of the harvester's threads (marking, completion, election, metering) died
        while it should run; such a process harvests no more and should be restarted."""
        engine = self._engine
        if engine is None or not self._started.is_set() or self._stopping.is_set():
            return True
        return engine.alive and self._elector.running and self._meter.is_alive()

    @property
    def is_leader(self) -> bool:
        """Whether this instance is harvesting now."""
        return self._engine is not None and self._engine.leader_id is not None

    @property
    def leader_id(self) -> UUID | None:
        """The id this instance marks records with, while leader."""
        return None if self._engine is None else self._engine.leader_id

    @property
    def in_flight_records(self) -> int:
        """Records published and not yet acknowledged and purged."""
        return 0 if self._engine is None else self._engine.in_flight_records

    @property
    def in_flight_keys(self) -> int:
        """Keys with a record in flight."""
        return 0 if self._engine is None else self._engine.in_flight_keys

    def health(self) -> dict[str, Any]:
        """Liveness of the dependencies, for readiness probes (each check bounded to ~2 s)."""
        db_ok = kafka_ok = False
        try:
            with psycopg.connect(self.config.data_source, connect_timeout=2) as conn:
                conn.execute("SELECT 1")
            db_ok = True
        except psycopg.Error:
            pass
        try:
            AdminClient(dict(self.config.base_kafka_config)).list_topics(timeout=2)
            kafka_ok = True
        except Exception:
            pass
        return {
            "database_ok": db_ok,
            "kafka_ok": kafka_ok,
            "is_leader": self.is_leader,
            "running": self._engine is not None and not self._stopped.is_set(),
        }

    # ------------------------------------------------------------------ internals

    def _emit_event(self, event: Event) -> None:
        log.info(type(event).__name__, **{k: str(v) for k, v in _fields(event).items()})
        if self._on_event is not None:
            self._on_event(event)

    def _meter_loop(self) -> None:
        interval = self.config.limits.min_metrics_interval.total_seconds()
        while not self._stopped.wait(interval):
            try:
                backlog, age = self._store.head()
            except StoreError:
                continue
            self.metrics.backlog.set(backlog)
            self.metrics.oldest_age.set(age or 0.0)
            engine = self._engine
            stats = {
                "backlog": float(backlog),
                "oldest_age_seconds": age or 0.0,
                "in_flight_records": float(engine.in_flight_records if engine else 0),
                "queued_records": float(engine.queued_records if engine else 0),
                "published": self.metrics.published._value.get(),
                "purged": self.metrics.purged._value.get(),
                "reset": self.metrics.reset._value.get(),
            }
            self._emit_event(MeterRead(stats))


def _tracing() -> dict[str, BatchScope]:
    """The OpenTelemetry publish span when the ``otel`` extra is installed; nothing otherwise."""
    try:
        from harvester.otel import publish_span
    except ImportError:
        return {}
    return {"batch_scope": publish_span}


def _fields(event: Event) -> dict[str, Any]:
    if isinstance(event, MeterRead):
        return dict(event.stats)
    return {name: getattr(event, name) for name in event.__slots__}

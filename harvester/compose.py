"""The composition root: the one module that knows which concrete classes a harvester is made of.

From a :class:`~harvester.config.HarvesterConfig` it builds the store (by the source: the table's
mark-purge store, or the log source composed of its parts: over a table, with a retention window,
table-less, or of Debezium's layout, :func:`log_store`), the
dispatcher (by the delivery mode) over a Kafka publisher, and the elector; a
:class:`~harvester.harvester.Harvester` runs what it builds. Everything else programs against the
core's protocols (docs/architecture.md, "Building a harvester").
"""

from __future__ import annotations

import os
from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

import psycopg
from confluent_kafka.admin import AdminClient
from prometheus_client.registry import Collector

from harvester.config import HarvesterConfig
from harvester.core.at_least_once import at_least_once
from harvester.core.dispatch import DispatcherFactory
from harvester.core.engine import Engine
from harvester.core.events import Event
from harvester.core.exactly_once import exactly_once
from harvester.core.identity import IdentityHeaders
from harvester.core.meter import HeadGauges
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import BatchScope, DeliveryCallback, Elector, Publisher, SourceGauges
from harvester.event_router import EventRouter
from harvester.kafka.native_publisher import NativePublisher, PlacingNativePublisher, native_built
from harvester.kafka.process_publisher import PlacingProcessPublisher, ProcessPublisher, runs_in_child
from harvester.kafka.publisher import KafkaPublisher, PlacingPublisher, producer_config
from harvester.kafka.topics import ensure_checkpoints
from harvester.kafka.transactions import KafkaTransactionalPublisher, PlacingTransactionalPublisher
from harvester.postgres.log.decoding import TableInserts
from harvester.postgres.log.deletes import Deletes
from harvester.postgres.log.event_router_layout import RouterInserts
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.messages import LogicalMessages
from harvester.postgres.log.parts import Decoding, Finish, Rows
from harvester.postgres.log.position import StoredPosition
from harvester.postgres.log.recovery import SlotRecoveries
from harvester.postgres.log.retention import RetentionWindow
from harvester.postgres.log.rows import RowLess, TableRows
from harvester.postgres.log.spill import spill_directory
from harvester.postgres.log.store import LogStore
from harvester.postgres.table.store import PostgresStore

if TYPE_CHECKING:
    from leader import ElectorConfig


@dataclass(frozen=True, slots=True)
class Source:
    """The store of the outbox (of its first shard) and what the meter samples of it."""

    store: PostgresStore
    gauges: SourceGauges
    collectors: tuple[Collector, ...] = ()  # series of the source's own, beside the meter's gauges


def source(config: HarvesterConfig) -> Source:
    """The configured source's store. Raises ``ValueError`` on a spill directory that takes no file
    (it would fail the leader in a large transaction)."""
    options = _store_options(config)
    dsn = config.data_source
    match config.source:
        case "mark_purge":
            # Unset: the store's default (at the acknowledgement, but holding dead-lettered keys).
            release = None if config.key_release is None else config.key_release == "acknowledged"
            table = PostgresStore(dsn, config.table, release_on_ack=release, **options)
            return Source(table, HeadGauges(table))
        case "log":
            retention = config.log_retention.total_seconds() if config.log_retention else None
            log = log_store(dsn, config.log_setup, retention=retention, router=config.event_router, **options)
            # Only a table's rows recover a lost slot (a table-less or Debezium outbox stops instead).
            recoverable = not config.log_messages and config.event_router is None
            return Source(log, log, (SlotRecoveries(log),) if recoverable else ())


def log_store(
    dsn: str, setup: LogSetup, *, retention: float | None = None, router: EventRouter | None = None, **options: Any
) -> LogStore:
    """The log source's store, composed of its parts (:mod:`harvester.postgres.log.parts`): the
    table-less outbox (``setup.prefix``) reads logical messages, a table of Debezium's layout
    (``router``) its inserts as EventRouter does, any other table its inserts; records in a table
    are deleted per batch, or with a ``retention`` window (seconds) in bulk after a stored position;
    records only in the log (table-less, Debezium's layout) complete by a stored position, their
    dead letters copied from memory."""
    table = setup.table
    window = RetentionWindow(table, retention) if retention else None
    decoding: Decoding
    finish: Finish
    rows: Rows
    if setup.prefix is not None:
        decoding, finish = LogicalMessages(setup.prefix), StoredPosition(table)
        rows = RowLess(table, check_failover=True)
    elif router is not None:  # its writers may delete each row in the transaction that inserts it
        decoding, finish = RouterInserts(router), StoredPosition(table, window)
        rows = RowLess(table, check_failover=False)  # it runs where Debezium runs, with the same exposure
    else:
        decoding, rows = TableInserts(), TableRows(table)
        finish = Deletes() if window is None else StoredPosition(table, window)
    return LogStore(dsn, setup, decoding=decoding, finish=finish, rows=rows, **options)


def _store_options(config: HarvesterConfig) -> dict[str, Any]:
    """The store's keyword arguments from ``config``."""
    options: dict[str, Any] = {
        "application_name": f"outbox-harvester {config.name}"[:63],
        "identity": IdentityHeaders(config.identity_header_prefix),
        "producer_name": config.producer_name,
        "hold_dead_letter_keys": config.dead_letter_policy == "hold_key",
        "vacuum_every": config.limits.vacuum_every_records,
        "statement_timeout": config.limits.statement_timeout.total_seconds(),
        "shards": config.shards,
    }
    if config.source == "log":
        options["transaction_memory"] = int(config.log_transaction_memory)
        try:
            options["spill_directory"] = spill_directory(config.log_spill_directory)
        except ValueError as exc:
            raise ValueError(f"logSpillDirectory: {exc}") from None
    return options


@dataclass(slots=True)
class Pipeline:
    """One shard's MP/R pipeline: its store, its dispatcher (the configured delivery mode over a
    Kafka producer of its own), its engine (built when the harvester starts) and its metrics. The
    pipelines of one harvester share nothing but the elector that drives them."""

    store: PostgresStore
    metrics: HarvesterMetrics
    engine: Engine | None = None


def build_engine(
    config: HarvesterConfig,
    pipeline: Pipeline,
    shard: int,
    *,
    emit: Callable[[Event], None],
    still_leader: Callable[[], bool],
    labels: Mapping[str, str],
    on_fatal: Callable[[Exception], None],
) -> Engine:
    """Shard ``shard``'s engine over ``pipeline``'s store and metrics, with a dispatcher of its own."""
    return Engine(
        pipeline.store,
        dispatcher(config, pipeline.store, shard),
        config.limits,
        pipeline.metrics,
        emit,
        listen_notify=config.listen_notify,
        still_leader=still_leader,
        shard=shard if config.shards > 1 else None,
        labels=labels,
        on_fatal=on_fatal,
        outbox=config.table.qualified,
        **tracing(),
    )


def dispatcher(config: HarvesterConfig, store: PostgresStore, shard: int) -> DispatcherFactory:
    """The configured delivery mode's dispatcher, over one shard's store and Kafka."""
    kafka = producer_config(config.base_kafka_config, config.producer_kafka_config)
    match config.delivery:
        case "exactly_once":
            ensure_checkpoints(config.base_kafka_config, config.checkpoints, config.shards)
            # One shard keeps the group's transactional id of before sharding; several fence per shard.
            transactional_id = f"{config.group_id}.harvester" + (f".{shard}" if config.shards > 1 else "")
            transactional = PlacingTransactionalPublisher if places(config) else KafkaTransactionalPublisher
            transactions = transactional(kafka, transactional_id, config.checkpoints, shard)
            return exactly_once(store, transactions)
        case "at_least_once":

            def factory(callback: DeliveryCallback) -> Publisher:
                return publisher(
                    kafka,
                    callback,
                    in_order=store.release_on_ack,
                    producer_process=config.producer_process,
                    placing=places(config),
                )

            return at_least_once(store, factory)


def publisher(
    kafka: Mapping[str, Any],
    callback: DeliveryCallback,
    *,
    in_order: bool,
    producer_process: bool | None = None,
    placing: bool = False,
) -> Publisher:
    """The at-least-once publisher: one that keeps order where the store releases a key at its
    acknowledgement (``keyRelease: acknowledged``), and then its producer's work per record off the
    harvester's interpreter, so that a second core produces while the harvester's reads the slot or
    the table: by default (``producer_process`` None) in the native loop in this process where it
    was built (``HARVESTER_PRODUCER_LOOP=python`` asks for the Python one), else in a child process;
    in a child process with ``producer_process`` True; in this process through confluent-kafka with
    False. With ``placing``, one that gives records their own timestamps and partitions (:func:`places`)."""
    if in_order and producer_process is not False and runs_in_child(kafka):
        native = os.environ.get("HARVESTER_PRODUCER_LOOP", "native") == "native" and native_built()
        if producer_process is None and native:
            return (PlacingNativePublisher if placing else NativePublisher)(kafka, callback, in_order=True)
        return (PlacingProcessPublisher if placing else ProcessPublisher)(kafka, callback, in_order=True)
    return (PlacingPublisher if placing else KafkaPublisher)(kafka, callback, in_order=in_order)


def places(config: HarvesterConfig) -> bool:
    """Whether the outbox's records may have timestamps or partitions of their own (Debezium's layout
    with ``table.field.event.timestamp`` or a ``partition`` placement): only then are the placing
    publishers, which read them, used."""
    return config.event_router is not None and config.event_router.places


def tracing() -> dict[str, BatchScope]:
    """The OpenTelemetry publish span when the ``otel`` extra is installed; nothing otherwise."""
    try:
        from harvester.otel import publish_span
    except ImportError:
        return {}
    return {"batch_scope": publish_span}


def raised_max_poll_interval(config: HarvesterConfig) -> float | None:
    """The election's session timeout when ``maxPollInterval`` is shorter (then it is used instead), else None.

    librdkafka wants ``max.poll.interval.ms`` no shorter than ``session.timeout.ms``. goharvest's
    ``maxPollInterval`` (default half of ``heartbeatTimeout``) bounded how long its send loop waited,
    not the consumer, so its files often set a few seconds. Raising it keeps every guarantee: order
    and fencing rest on partition 0 of the leader topic and the epoch, not on this bound; a longer one
    only gives a revocation's drain more time before the partition moves, and lets a leader whose poll
    thread hangs hold on for the session timeout, as long as a crashed one does.
    """
    from leader import ElectorConfig

    session_timeout = float(ElectorConfig.model_fields["session_timeout"].default)
    return session_timeout if config.limits.max_poll_interval.total_seconds() < session_timeout else None


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
        max_poll_interval=raised_max_poll_interval(config) or limits.max_poll_interval.total_seconds(),
        name=config.name,
        partitions=config.shards,
    )


def neli_elector(
    config: HarvesterConfig,
    report: Callable[[int], Mapping[str, float]] | None = None,
    healthy: Callable[[], bool] | None = None,
) -> Elector:
    """The default elector: Fast NELI over the configured leader group and topic; its heartbeats
    carry ``report`` of their shard, and it steps down while ``healthy`` says no."""
    from leader import NeliElector

    return NeliElector(elector_config(config), report=report, healthy=healthy)


def reachable(config: HarvesterConfig) -> dict[str, bool]:
    """What a readiness probe checks of the services, each bounded to ~2 s: the database, Kafka, and
    the outbox table (it may be dropped while the harvester runs)."""
    db_ok = kafka_ok = outbox_ok = False
    try:
        with psycopg.connect(config.data_source, connect_timeout=2) as conn:
            row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (config.table.quoted,)).fetchone()
        db_ok, outbox_ok = True, bool(row and row[0])
    except psycopg.Error:
        pass
    try:
        AdminClient(dict(config.base_kafka_config)).list_topics(timeout=2)
        kafka_ok = True
    except Exception:
        pass
    return {"database_ok": db_ok, "kafka_ok": kafka_ok, "outbox_ok": outbox_ok}

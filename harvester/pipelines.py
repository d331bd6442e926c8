"""One shard's MP/R pipeline as a :class:`~harvester.harvester.Harvester` builds it: its store, its
dispatcher (the configured delivery mode over a Kafka producer of its own), its engine and its
metrics. The pipelines of one harvester share nothing but the elector that drives them."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from dataclasses import dataclass
from typing import Any

from harvester.config import HarvesterConfig
from harvester.core.at_least_once import at_least_once
from harvester.core.dispatch import DispatcherFactory
from harvester.core.engine import Engine
from harvester.core.events import Event
from harvester.core.exactly_once import exactly_once
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import BatchScope, DeliveryCallback, Publisher
from harvester.kafka.process_publisher import ProcessPublisher, runs_in_child
from harvester.kafka.publisher import KafkaPublisher, producer_config
from harvester.kafka.topics import ensure_topic, require_partitions
from harvester.kafka.transactions import KafkaTransactionalPublisher
from harvester.postgres.store import PostgresStore


@dataclass(slots=True)
class Pipeline:
    """One shard's MP/R pipeline; its engine is built when the harvester starts."""

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
    if config.delivery == "exactly_once":
        ensure_topic(config.base_kafka_config, config.checkpoints, partitions=config.shards)
        if config.shards > 1:
            require_partitions(config.base_kafka_config, config.checkpoints, config.shards)
        # One shard keeps the group's transactional id of before sharding; several fence per shard.
        transactional_id = f"{config.group_id}.harvester" + (f".{shard}" if config.shards > 1 else "")
        transactions = KafkaTransactionalPublisher(kafka, transactional_id, config.checkpoints, shard)
        return exactly_once(store, transactions)

    def factory(callback: DeliveryCallback) -> Publisher:
        return publisher(kafka, callback, in_order=store.release_on_ack, in_child=config.producer_process)

    return at_least_once(store, factory)


def publisher(
    kafka: Mapping[str, Any], callback: DeliveryCallback, *, in_order: bool, in_child: bool = True
) -> Publisher:
    """The at-least-once publisher: one that keeps order where the store releases a key at its
    acknowledgement (the log source), and then, with ``in_child``, its producer in a child process.
    The log source's drain is bound by the harvester's interpreter; mark-purge's, by its database."""
    if in_order and in_child and runs_in_child(kafka):
        return ProcessPublisher(kafka, callback, in_order=True)
    return KafkaPublisher(kafka, callback, in_order=in_order)


def tracing() -> dict[str, BatchScope]:
    """The OpenTelemetry publish span when the ``otel`` extra is installed; nothing otherwise."""
    try:
        from harvester.otel import publish_span
    except ImportError:
        return {}
    return {"batch_scope": publish_span}

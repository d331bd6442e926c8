"""Exactly-once publishing: each marked batch and a checkpoint of its ids commit in one Kafka
transaction (confluent-kafka transactional producer).

The group shares one ``transactional.id``: a new leader's ``init_transactions`` aborts whatever
the previous leader left open and fences its producer, so a zombie can no longer commit. The
checkpoint topic records, per committed batch, the outbox ids it contained; a new leader re-reads
the checkpoints it has not seen purged and purges those ids before its first mark.

A sharded outbox has one transactional id per shard, and shard ``i`` keeps its checkpoints in
partition ``i`` of the checkpoint topic.
"""

from __future__ import annotations

import contextlib
import json
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

from confluent_kafka import Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition

from harvester.core.protocols import ProducerFencedError, RefusedError, TransactionAbortedError
from harvester.core.records import MarkedRecord, placement
from harvester.kafka.publisher import DeliveryError


@dataclass(frozen=True, slots=True)
class Checkpoint:
    """What a committed transaction contained."""

    ids: list[int]
    epoch: int


class KafkaTransactionalPublisher:
    """:class:`harvester.core.protocols.TransactionalPublisher` over confluent-kafka."""

    def __init__(
        self, config: Mapping[str, Any], transactional_id: str, checkpoint_topic: str, partition: int = 0
    ) -> None:
        self._config = {
            **config,
            "transactional.id": transactional_id,
            "enable.idempotence": True,
            "acks": "all",
            "transaction.timeout.ms": int(config.get("transaction.timeout.ms", 60000)),
        }
        self._topic = checkpoint_topic
        self._partition = partition
        self._producer: Producer | None = None
        # Whether the producer reported itself fenced: flushing it then raises its fatal error, or
        # fails inside a delivery callback (SystemError, seen closing one); it is discarded unflushed.
        self._fenced = False
        self._lock = threading.Lock()
        self._failures: dict[int, Exception] = {}
        self._position = 0

    def init(self) -> None:
        """(Re)create the producer and initialise transactions, fencing any previous holder."""
        self._discard(0)
        self._producer = Producer(self._config)
        try:
            self._producer.init_transactions(30)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.code() == KafkaError.TRANSACTIONAL_ID_AUTHORIZATION_FAILED:
                tid = self._config["transactional.id"]
                raise RefusedError(
                    f"Kafka ACL missing: may not WRITE transactional id {tid}: allow WRITE on transactional id "
                    f"{tid} (docs/security.md)"
                ) from exc
            if error.fatal():
                raise ProducerFencedError(error.str()) from exc
            raise TransactionAbortedError(f"init_transactions: {error.str()}", {}) from exc

    def publish_batch(self, records: Sequence[MarkedRecord], epoch: int) -> int:
        """Produce ``records`` and their checkpoint in one transaction, commit it, and return the
        checkpoint position after it.

        Raises :class:`TransactionAbortedError` (batch not published; retry after a remark) or
        :class:`ProducerFencedError` (stop leader work).
        """
        producer = self._producer
        assert producer is not None, "init() first"
        self._failures = {}
        try:
            producer.begin_transaction()
            for record in records:
                self._produce(producer, record)
            checkpoint = json.dumps({"epoch": epoch, "ids": [r.id for r in records]}).encode()
            producer.produce(self._topic, value=checkpoint, partition=self._partition, on_delivery=self._on_checkpoint)
            producer.commit_transaction(60)
            return self._position
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            if error.fatal() or error.code() in (KafkaError._FENCED, KafkaError.PRODUCER_FENCED):
                self._fenced = True
                raise ProducerFencedError(error.str()) from exc
            self._abort(producer)
            raise TransactionAbortedError(error.str(), dict(self._failures)) from exc
        except BufferError as exc:
            self._abort(producer)
            raise TransactionAbortedError("producer queue full", {}) from exc

    def _produce(self, producer: Producer, record: MarkedRecord) -> None:
        def report(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self._failures[record.id] = DeliveryError(err, record.topic)

        try:
            producer.produce(
                record.topic,
                value=record.value,
                key=record.key.encode(),
                headers=record.kafka_headers(),
                on_delivery=report,
            )
        except KafkaException as exc:
            self._failures[record.id] = DeliveryError(exc.args[0], record.topic)
            raise

    def _on_checkpoint(self, err: KafkaError | None, msg: Message) -> None:
        offset = msg.offset()
        if err is None and offset is not None:
            self._position = offset + 1

    def _abort(self, producer: Producer) -> None:
        try:
            producer.abort_transaction(30)
        except KafkaException as exc:
            self._fenced = True
            raise ProducerFencedError(f"abort failed: {exc}") from exc

    def recover(self, position: int) -> tuple[list[int], int]:
        """Outbox ids of committed checkpoints from ``position`` on, and the end position."""
        try:
            checkpoints, end = read_checkpoints(self._config, self._topic, position, self._partition)
        except (KafkaException, TimeoutError) as exc:
            raise TransactionAbortedError(f"reading checkpoints: {exc}", {}) from exc
        return [i for c in checkpoints for i in c.ids], end

    def close(self, timeout: float) -> None:
        """Release the producer (an open transaction is aborted by the next leader's init)."""
        self._discard(timeout)

    def _discard(self, timeout: float) -> None:
        """Let go of the producer, flushed for up to ``timeout`` unless it is fenced. A producer
        fenced mid-transaction unbeknown to us raises its fatal error here: it is discarded anyway
        (seen in a chaos run, where it killed the mark thread at the start of a new term)."""
        producer, self._producer = self._producer, None
        fenced, self._fenced = self._fenced, False
        if producer is not None and not fenced:
            with contextlib.suppress(KafkaException):
                producer.flush(timeout)


class PlacingTransactionalPublisher(KafkaTransactionalPublisher):
    """A :class:`KafkaTransactionalPublisher` of records that may have a timestamp or partition of their own
    (:class:`~harvester.core.records.PlacedRecord`): a produce of its own, so that the base class's
    does no more per record for the layouts that place none."""

    def _produce(self, producer: Producer, record: MarkedRecord) -> None:
        def report(err: KafkaError | None, _msg: Message) -> None:
            if err is not None:
                self._failures[record.id] = DeliveryError(err, record.topic)

        timestamp, partition = placement(record)
        try:
            producer.produce(
                record.topic,
                value=record.value,
                key=record.key.encode(),
                headers=record.kafka_headers(),
                timestamp=timestamp,
                partition=partition,
                on_delivery=report,
            )
        except KafkaException as exc:
            self._failures[record.id] = DeliveryError(exc.args[0], record.topic)
            raise


def read_checkpoints(
    config: Mapping[str, Any], topic: str, position: int, partition: int = 0
) -> tuple[list[Checkpoint], int]:
    """Committed checkpoints of ``partition`` from ``position`` to the end (read committed); and the
    end position."""
    consumer = Consumer(
        {
            **{k: v for k, v in config.items() if not k.startswith(("transactional", "enable.idempotence", "acks"))},
            "group.id": f"{topic}.recovery",
            "isolation.level": "read_committed",
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "auto.offset.reset": "earliest",
        }
    )
    found: list[Checkpoint] = []
    end = position
    try:
        low, high = consumer.get_watermark_offsets(TopicPartition(topic, partition), timeout=10)
        start = max(position, low)
        if start >= high:
            return found, max(position, high)
        consumer.assign([TopicPartition(topic, partition, start)])
        while True:
            msg = consumer.poll(10)
            if msg is None:
                raise TimeoutError(f"checkpoint topic {topic}: no end-of-partition within 10 s")
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    end = max(end, int(msg.offset() or 0))
                    break
                raise KafkaException(err)
            body = json.loads(msg.value() or b"{}")
            found.append(Checkpoint([int(i) for i in body.get("ids", [])], int(body.get("epoch", 0))))
            end = int(msg.offset() or 0) + 1
    finally:
        consumer.close()
    return found, end

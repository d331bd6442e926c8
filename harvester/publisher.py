"""Publishing marked records to Kafka with confluent-kafka.

Delivery reports are served by a dedicated poll thread that only hands them to the engine's
callback (which queues them), so librdkafka's callbacks never wait on database I/O and marking
never waits on callbacks.
"""

from __future__ import annotations

import threading
import time
from collections.abc import Mapping
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from harvester.protocols import DeliveryCallback
from harvester.record import MarkedRecord


class DeliveryError(Exception):
    """Kafka did not accept a record. ``retriable`` tells a transient fault from a permanent one."""

    def __init__(self, error: KafkaError) -> None:
        super().__init__(error.str())
        self.code: int = error.code()
        self.name: str = error.name()
        self.retriable: bool = bool(error.retriable())


def producer_config(base: Mapping[str, Any], producer: Mapping[str, Any]) -> dict[str, Any]:
    """Merge goharvest-style ``base`` and ``producer`` maps over the harvester's defaults."""
    return {
        "enable.idempotence": True,
        "acks": "all",
        "linger.ms": 5,
        "compression.type": "lz4",
        **base,
        **producer,
    }


class KafkaPublisher:
    """:class:`harvester.protocols.Publisher` backed by one idempotent producer."""

    def __init__(self, config: Mapping[str, Any], on_delivery: DeliveryCallback) -> None:
        self._producer = Producer(dict(config))
        self._on_delivery = on_delivery
        self._closing = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="harvester-delivery", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._closing.is_set():
            self._producer.poll(0.05)

    def publish(self, record: MarkedRecord) -> None:
        """Enqueue ``record``; a local failure is reported through the delivery callback at once."""
        callback = self._on_delivery

        def report(err: KafkaError | None, _msg: Message) -> None:
            callback(record, None if err is None else DeliveryError(err))

        while True:
            try:
                self._producer.produce(
                    record.topic,
                    value=record.value,
                    key=record.key.encode("utf-8"),
                    headers=record.headers,
                    on_delivery=report,
                )
                return
            except BufferError:
                # librdkafka's local queue is full: the poll thread drains it as acks arrive.
                time.sleep(0.005)
            except KafkaException as exc:
                callback(record, DeliveryError(exc.args[0]))
                return

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` for outstanding deliveries; return how many remain."""
        return int(self._producer.flush(timeout))

    def close(self, timeout: float) -> None:
        """Flush (bounded), drop what is still undelivered, and stop the poll thread.

        Dropped records stay marked in the outbox and are published by the next leader; without the
        purge, librdkafka would hold the process until they time out.
        """
        if self._producer.flush(timeout):
            self._producer.purge()
            self._producer.flush(0)
        self._closing.set()
        self._poller.join()

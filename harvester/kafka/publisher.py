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

from harvester.core.failures import PublishError
from harvester.core.protocols import DeliveryCallback
from harvester.core.records import MarkedRecord

# Errors that concern the record itself, so that publishing it again cannot succeed (too large,
# invalid, unknown or forbidden topic); every other error is waited out.
_PERMANENT_NAMES = (
    "MSG_SIZE_TOO_LARGE",
    "RECORD_LIST_TOO_LARGE",
    "INVALID_RECORD",
    "TOPIC_EXCEPTION",
    "_UNKNOWN_TOPIC",
    "UNKNOWN_TOPIC_OR_PART",
    "TOPIC_AUTHORIZATION_FAILED",
    "POLICY_VIOLATION",
    "UNSUPPORTED_FOR_MESSAGE_FORMAT",
    "_INVALID_ARG",
    "_BAD_MSG",
)
PERMANENT_CODES = frozenset(getattr(KafkaError, n) for n in _PERMANENT_NAMES if hasattr(KafkaError, n))


class DeliveryError(PublishError):
    """Kafka did not accept a record; its error code decides whether that is permanent."""

    def __init__(self, error: KafkaError) -> None:
        label = error.name().lower().lstrip("_")
        super().__init__(error.str(), reason=label, permanent=error.code() in PERMANENT_CODES)
        self.code: int = error.code()


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
    """:class:`harvester.core.protocols.Publisher` backed by one idempotent producer."""

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
            callback((record, None if err is None else DeliveryError(err)))

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
                callback((record, DeliveryError(exc.args[0])))
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

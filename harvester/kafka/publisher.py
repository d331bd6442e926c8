"""Publishing marked records to Kafka with confluent-kafka.

Delivery reports are served by a dedicated poll thread that only hands them to the engine's
callback (which queues them), so librdkafka's callbacks never wait on database I/O and marking
never waits on callbacks.
"""

from __future__ import annotations

import threading
from collections.abc import Mapping, Sequence
from typing import Any

import structlog
from confluent_kafka import KafkaError, KafkaException, Message, Producer

from harvester.core.failures import PublishError
from harvester.core.protocols import DeliveryCallback, RefusedError
from harvester.core.records import MarkedRecord, placement
from harvester.kafka.enqueue import Placing, enqueue

log = structlog.get_logger("harvester.kafka")

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
    "_UNKNOWN_PARTITION",  # a partition the topic does not have, which only a record's own placement names
    "_BAD_MSG",
)
PERMANENT_CODES = frozenset(getattr(KafkaError, n) for n in _PERMANENT_NAMES if hasattr(KafkaError, n))
# Of those, the errors a broker answers for a partition's whole batch in a produce request: one record
# too large (or the batch as a whole) fails every record that shared the batch with it.
_SHARED_NAMES = ("MSG_SIZE_TOO_LARGE", "RECORD_LIST_TOO_LARGE", "INVALID_RECORD")
SHARED_CODES = frozenset(getattr(KafkaError, n) for n in _SHARED_NAMES if hasattr(KafkaError, n))


class DeliveryError(PublishError):
    """Kafka did not accept a record; its error code decides whether that is permanent, and whether
    the refusal may have been of the record's whole batch (shared). A refusal of the record's topic
    names the ACL that fixes it (docs/security.md)."""

    def __init__(self, error: KafkaError, topic: str | None = None) -> None:
        label, code = error.name().lower().lstrip("_"), error.code()
        text = str(error.str())
        if topic is not None and code == KafkaError.TOPIC_AUTHORIZATION_FAILED:
            text += f": Kafka ACL missing: allow WRITE on topic {topic} (docs/security.md)"
        super().__init__(text, reason=label, permanent=code in PERMANENT_CODES, shared=code in SHARED_CODES)
        self.code: int = error.code()


def refusal(error: KafkaError) -> RefusedError:
    """A fatal error of the producer in one line, naming the ACL when Kafka refused it a producer id."""
    text = str(error.str())
    if error.code() == KafkaError.CLUSTER_AUTHORIZATION_FAILED:
        return RefusedError(
            f"Kafka refused the producer: {text}: allow WRITE on the output topics to the producer's principal"
            " (an idempotent producer takes its producer id with WRITE on any topic, KIP-679; docs/security.md)"
        )
    return RefusedError(f"Kafka producer failed for good: {text}")


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


# The delivery timeout's two names; a message that times out in librdkafka's queue leaves a gap in
# its partition that later ones fill (its INTRODUCTION.md, "Message timeout considerations").
_TIMEOUTS = ("message.timeout.ms", "delivery.timeout.ms")


def _ordered(settings: Mapping[str, Any]) -> bool:
    """Whether ``settings`` make an idempotent producer without a delivery timeout (values as given,
    booleans or text)."""
    idempotent = str(settings.get("enable.idempotence", "false")).strip().lower() in ("true", "1")
    return idempotent and all(str(settings.get(name, "0")).strip() == "0" for name in _TIMEOUTS)


def delivery_settings(config: Mapping[str, Any], in_order: bool) -> tuple[dict[str, Any], bool]:
    """The producer's settings for ``config``, and whether it keeps order: asked to (``in_order``)
    and able to (:class:`KafkaPublisher` says when), it gets no delivery timeout."""
    settings = dict(config)
    keeps_order = in_order and _ordered(settings)
    if keeps_order:
        settings["message.timeout.ms"] = 0  # no timeout
        settings.pop("delivery.timeout.ms", None)
    return settings, keeps_order


class KafkaPublisher:
    """:class:`harvester.core.protocols.Publisher` backed by one idempotent producer.

    With ``in_order``, it keeps order (:attr:`keeps_order`) unless the configuration sets a delivery
    timeout or turns idempotence off: the idempotent producer writes a partition's records in
    sequence, retrying what a broker did not acknowledge, and only a timeout lets a later record
    through without an earlier one. So records wait out an unreachable broker instead of failing
    after librdkafka's default 5 minutes. An error about the record itself (too large, invalid)
    still fails it alone, while its key's next records may be written: it is retried until it is
    dead-lettered, so it lands out of order only if a retry succeeds, after a broker limit was raised
    in between. The broker gives such an error to the record's whole batch (:data:`SHARED_CODES`): a
    record that only shared it is retried alone and succeeds, after its key's later records if they
    went in later batches.
    """

    _placing = False  # whether records may have a timestamp or partition of their own

    def __init__(self, config: Mapping[str, Any], on_delivery: DeliveryCallback, *, in_order: bool = False) -> None:
        settings, self.keeps_order = delivery_settings(config, in_order)
        self._producer = Producer(settings)
        self._on_delivery = on_delivery
        self._refused: RefusedError | None = None  # the producer's fatal error, once it had one
        self._closing = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="harvester-delivery", daemon=True)
        self._poller.start()

    def _poll(self) -> None:
        while not self._closing.is_set():
            try:
                self._producer.poll(0.05)
            except KafkaException as exc:
                # A fatal error (raised once, by poll): the producer publishes nothing more. Polling
                # goes on, so the records it holds come back failed, reported as this refusal.
                self._refused = refusal(exc.args[0])

    def publish(self, records: Sequence[MarkedRecord]) -> None:
        """Enqueue ``records``; a local failure is reported through the delivery callback at once.
        Raises :class:`RefusedError` once the producer failed for good."""
        if self._refused is not None:
            raise self._refused
        for record in records:
            self._enqueue(record)

    def _enqueue(self, record: MarkedRecord) -> None:
        callback = self._on_delivery

        def report(err: KafkaError | None, _msg: Message) -> None:
            refused = self._refused
            failed = None if err is None else (refused or DeliveryError(err, record.topic))
            callback((record, failed))

        to = Placing(self._producer, *placement(record)) if self._placing else self._producer
        try:
            # The key is encoded to UTF-8 by the client.
            error = enqueue(to, record.topic, record.key, record.value, record.kafka_headers(), report)
        except Exception as exc:  # a record the client cannot take: it alone fails, settled and re-marked
            log.exception("publish_failed", id=record.id)
            callback((record, exc))
            return
        if error is not None:
            callback((record, self._refused or DeliveryError(error, record.topic)))

    def begin_term(self) -> None:
        """Nothing to do: the producer keeps no state per term."""

    def flush(self, timeout: float) -> int:
        """Wait up to ``timeout`` for outstanding deliveries; return how many remain."""
        return int(self._producer.flush(timeout))

    def close(self, timeout: float) -> None:
        """Flush (bounded), drop what is still undelivered, and stop the poll thread.

        Dropped records stay marked in the outbox and are published by the next leader; without the
        purge, librdkafka would hold the process until they time out.
        """
        try:
            left = self._producer.flush(timeout)
        except KafkaException:  # the fatal error, raised here rather than in the poll thread
            left = len(self._producer)
        if left:
            self._producer.purge()
            self._producer.flush(0)
        self._closing.set()
        self._poller.join()


class PlacingPublisher(KafkaPublisher):
    """A :class:`KafkaPublisher` of records that may have a timestamp or partition of their own
    (:class:`~harvester.core.records.PlacedRecord`): it gives them to the producer, which the others'
    publisher need not look for."""

    _placing = True

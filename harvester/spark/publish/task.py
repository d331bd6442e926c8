"""One task of the ``outbox-publish`` sink, on an executor: its shard's records of a micro-batch
published with the reaper's producer, and what Kafka refused for good.

The producer is the reaper's (:mod:`harvester.kafka.publisher`): idempotent, no delivery timeout,
so it writes each partition's records in sequence and waits out an unreachable broker; librdkafka's
default partitioner places a key as a reaper's does. A record is sent again after a permanent
refusal (a missing or forbidden topic, a broker's policy), up to ``maxAttempts`` sends in all, as a
reaper counts attempts, unless a later record of its key was delivered meanwhile: sending it then
would put it after that one, so it is refused at once. What is left is returned for the driver to
dead-letter. Anything else the producer reports (a delivery timeout the user set) fails the task:
Spark runs it again, and nothing is lost.
"""

from __future__ import annotations

import threading
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from datetime import UTC, datetime
from functools import partial
from typing import NamedTuple

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from harvester.core.records import Failure
from harvester.kafka.enqueue import enqueue
from harvester.kafka.publisher import DeliveryError, delivery_settings, producer_config, refusal

_FLUSH_WAIT = 1.0  # seconds per flush call while records are outstanding

_producers: dict[tuple[tuple[str, str], ...], Producer] = {}
_lock = threading.Lock()


def producer(kafka: Mapping[str, str]) -> Producer:
    """The Python worker's producer for ``kafka`` (Spark reuses a worker for later tasks, so later
    batches skip the connection and the topics' metadata)."""
    key = tuple(sorted(kafka.items()))
    with _lock:
        found = _producers.get(key)
        if found is None:
            settings, _ = delivery_settings(producer_config(kafka, {}), in_order=True)
            found = _producers[key] = Producer(settings)
        return found


class Record(NamedTuple):
    """A drained row as the sink publishes it (a tuple: one is made per record, and a frozen
    dataclass's construction cost several times as much)."""

    id: int
    topic: str
    key: str | None
    value: bytes | None
    headers: list[tuple[str, bytes | None]]


@dataclass(frozen=True, slots=True)
class Refusal:
    """A record Kafka refused for good, with the epoch its shard's term published it under."""

    epoch: int
    failure: Failure


def _epoch(record: Record, header: str) -> int:
    for name, value in record.headers:
        if name == header and value is not None:
            return int(value)
    raise ValueError(f"record {record.id} has no {header} header: is the sink fed by readStream.format('outbox')?")


class _Round:
    """One send of the records still pending: the refusals, collected by ``flush``. Only refusals
    are recorded as reports come; what was delivered is worked out after a round that had some."""

    def __init__(self) -> None:
        self.errors: dict[int, DeliveryError] = {}
        self.sent: list[Record] = []

    def _report(self, rid: int, err: KafkaError | None, _msg: Message) -> None:
        if err is not None:
            self.errors[rid] = DeliveryError(err)

    def send(self, client: Producer, records: Iterable[Record]) -> list[Record]:
        """Send ``records`` in order (each as it comes: the producer's thread sends the first ones
        while the caller reads more) and wait for every report; return the refused ones."""
        sent = self.sent

        def serve() -> None:
            client.poll(0)

        for record in records:
            sent.append(record)
            report = partial(self._report, record.id)
            # Nothing else polls this producer: a full queue empties as its reports are served here.
            refused = enqueue(client, record.topic, record.key or "", record.value, record.headers, report, serve)
            if refused is not None:
                self.errors[record.id] = DeliveryError(refused)
        while client.flush(_FLUSH_WAIT):
            pass
        if not self.errors:
            return []
        failed = [r for r in sent if r.id in self.errors]
        for record in failed:
            error = self.errors[record.id]
            if not error.permanent:
                raise RuntimeError(f"publishing record {record.id} to {record.topic} failed: {error}")
        return failed


class Outcome(NamedTuple):
    """What a task published: how many records it was given, and those Kafka refused for good."""

    records: int
    refused: list[Refusal]


def publish(kafka: Mapping[str, str], records: Iterable[Record], max_attempts: int, epoch_header: str) -> Outcome:
    """Publish ``records`` (one shard's, in id order, sent as they come); return how many there were
    and those refused after their attempts.
    A producer that failed for good (Kafka refused it a producer id: no WRITE on any topic) fails
    the task with one line naming the ACL, and is dropped, so that Spark's retry starts another."""
    try:
        return _publish(producer(kafka), records, max_attempts, epoch_header)
    except KafkaException as exc:
        error: KafkaError = exc.args[0]
        if not error.fatal():
            raise
        with _lock:
            _producers.pop(tuple(sorted(kafka.items())), None)
        raise RuntimeError(str(refusal(error))) from None


def _publish(client: Producer, records: Iterable[Record], max_attempts: int, epoch_header: str) -> Outcome:
    pending: Iterable[Record] = records
    delivered_last: dict[str | None, int] = {}  # key -> its highest id delivered
    first: dict[int, datetime] = {}
    refused: list[Refusal] = []
    total = 0
    for attempt in range(1, max_attempts + 1):
        sent = _Round()
        failed = sent.send(client, pending)
        if attempt == 1:
            total = len(sent.sent)
        if not failed:
            break
        for record in sent.sent:
            if record.id not in sent.errors:
                delivered_last[record.key] = max(record.id, delivered_last.get(record.key, 0))
        again: list[Record] = []
        for record in failed:
            first.setdefault(record.id, datetime.now(UTC))
            if attempt < max_attempts and delivered_last.get(record.key, 0) < record.id:
                again.append(record)  # nothing of its key after it is in Kafka: send it again
                continue
            error = sent.errors[record.id]
            failure = Failure(record.id, record.key or "", error.reason, str(error)[:2000], attempt, first[record.id])
            refused.append(Refusal(_epoch(record, epoch_header), failure))
        if not again:
            break
        pending = again
    return Outcome(total, refused)

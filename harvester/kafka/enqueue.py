"""Handing one record to a confluent-kafka producer, waiting while its local queue is full: the rule
the in-process publisher and the producer process share. Imports nothing but confluent-kafka, so
that the producer process starts quickly."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

_FULL_WAIT = 0.005  # seconds between tries while librdkafka's local queue is full


class Placing:
    """A producer whose ``produce`` gives one record's timestamp (milliseconds since the epoch; 0: the
    producer's clock) and partition (-1: the partitioner's), for the records a layout places
    (:class:`harvester.core.records.PlacedRecord`); the other records go to the producer itself,
    with nothing more per record."""

    __slots__ = ("_partition", "_producer", "_timestamp")

    def __init__(self, producer: Producer, timestamp: int, partition: int) -> None:
        self._producer = producer
        self._timestamp = timestamp
        self._partition = partition

    def produce(self, topic: str, **kwargs: Any) -> None:
        self._producer.produce(topic, timestamp=self._timestamp, partition=self._partition, **kwargs)


def enqueue(
    producer: Producer | Placing,
    topic: str,
    key: str,
    value: bytes | None,
    headers: Any,
    on_delivery: Callable[[KafkaError | None, Message], None],
    while_full: Callable[[], None] | None = None,
) -> KafkaError | None:
    """Produce one record; None once librdkafka holds it, or the error that refused it outright.

    A full queue is waited out (another thread polls, so acknowledgements empty it); ``while_full``
    runs on each wait, to give up by raising or exiting."""
    while True:
        try:
            producer.produce(topic, value=value, key=key, headers=headers, on_delivery=on_delivery)
            return None
        except BufferError:
            if while_full is not None:
                while_full()
            time.sleep(_FULL_WAIT)
        except KafkaException as exc:
            error: KafkaError = exc.args[0]
            return error

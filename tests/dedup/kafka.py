"""Kafka helpers of the de-duplication tests: write harvester-shaped copies, read through a reader."""

from __future__ import annotations

import time
from collections import defaultdict
from collections.abc import Iterator, Sequence
from contextlib import contextmanager
from typing import Any

from confluent_kafka import Consumer, Message, Producer, TopicPartition

from harvester.client.dedup import DedupReader
from harvester.core.identity import IdentityHeaders
from tests.dedup.model import Copy, first_copies
from tests.support.kafka import text
from tests.support.names import unique
from tests.support.services import Services

PRODUCER = "db-1/public.outbox"


def produce(bootstrap: str, topic: str, copies: Sequence[Copy]) -> None:
    """Write ``copies`` as the harvester would: value ``<key>:<id>``, identity headers."""
    names = IdentityHeaders()
    producer = Producer({"bootstrap.servers": bootstrap, "enable.idempotence": True, "linger.ms": 5})
    for key, rid, epoch in copies:
        headers: list[tuple[str, str | bytes | None]] = [
            (names.id, str(rid).encode()),
            (names.epoch, str(epoch).encode()),
            (names.producer, PRODUCER),
        ]
        producer.produce(topic, key=key.encode(), value=f"{key}:{rid}".encode(), headers=headers)
    assert producer.flush(30) == 0


@contextmanager
def consumer(services: Services, **extra: Any) -> Iterator[Consumer]:
    """A consumer in a group of its own, auto-commit off; ``extra`` overrides its configuration."""
    c = Consumer(
        services.kafka(**{"group.id": unique("dedup"), "enable.auto.commit": False, "auto.offset.reset": "earliest"})
        | extra
    )
    try:
        yield c
    finally:
        c.close()


def ends(c: Consumer, topic: str, partitions: int) -> dict[tuple[str, int], int]:
    """High watermarks of the topic's non-empty partitions."""
    out = {}
    for p in range(partitions):
        high = c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1]
        if high > 0:
            out[(topic, p)] = high
    return out


def read_to(reader: DedupReader, end: dict[tuple[str, int], int], timeout: float = 30) -> list[Message]:
    """Everything the reader keeps until it has consumed up to ``end`` on every partition."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    while any(reader.positions().get(tp, 0) < off for tp, off in end.items()):
        assert time.monotonic() < deadline, f"stuck at {reader.positions()}, want {end}"
        out += [m for m in reader.consume(500, 0.2) if m.error() is None]
    return out


def by_key(messages: Sequence[Message]) -> dict[str, list[str]]:
    """Message values per key, in the order read."""
    got: dict[str, list[str]] = defaultdict(list)
    for m in messages:
        got[text(m.key())].append(text(m.value()))
    return dict(got)


def expected(copies: Sequence[Copy]) -> dict[str, list[str]]:
    """Per key, the values an exactly-once reader yields from ``copies``, in order."""
    want: dict[str, list[str]] = defaultdict(list)
    for key, rid, _ in first_copies(list(copies)):
        want[key].append(f"{key}:{rid}")
    return dict(want)

"""Kafka helpers: topics created, configured and deleted, and read back from the beginning."""

from __future__ import annotations

import time
from collections.abc import Iterator
from contextlib import contextmanager, suppress
from typing import Any, cast

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic

from tests.support.names import unique


def create_topics(bootstrap: str, names: list[str], partitions: int = 1, **config: str) -> None:
    admin = AdminClient({"bootstrap.servers": bootstrap})
    futures = admin.create_topics(
        [NewTopic(n, num_partitions=partitions, replication_factor=1, config=config) for n in names]
    )
    for f in futures.values():
        f.result(30)


def delete_topics(bootstrap: str, names: list[str]) -> None:
    if not names:
        return
    admin = AdminClient({"bootstrap.servers": bootstrap})
    for f in admin.delete_topics(names, operation_timeout=30).values():
        with suppress(Exception):  # already gone is fine
            f.result(30)


@contextmanager
def reader(bootstrap: str, topics: list[str], **extra: Any) -> Iterator[Consumer]:
    """A consumer reading ``topics`` from the beginning, in its own throwaway group."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": unique("reader"),
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
            **extra,
        }
    )
    consumer.subscribe(topics)
    try:
        yield consumer
    finally:
        consumer.close()


def read_distinct(bootstrap: str, topic: str, distinct: int, timeout: float = 120, **extra: Any) -> list[Message]:
    """Every message of ``topic`` once ``distinct`` different values came (copies do not count
    towards it), and whatever came in 1 s more; ``extra``: the consumer's settings (isolation level)."""
    out: list[Message] = []
    values: set[bytes | None] = set()
    deadline, settle = time.monotonic() + timeout, None
    with reader(bootstrap, [topic], **extra) as consumer:
        while time.monotonic() < (settle or deadline):
            for msg in consumer.consume(1000, 0.2):
                if msg.error() is None:
                    out.append(msg)
                    values.add(msg.value())
            if settle is None and len(values) >= distinct:
                settle = time.monotonic() + 1.0
    return out


# The first signature admits consumer settings given as an unpacked ``dict[str, str]`` (``**COMMITTED``):
# mypy checks the values of such a dict against every parameter that can be passed by name, so against
# the second signature's ``timeout`` (a float) too.
def read_messages(bootstrap: str, topics: list[str], count: int, timeout: float = 60.0, **extra: Any) -> list[Message]:
    """Read until ``count`` messages arrived (or ``timeout`` passed) and then 1 s more, to catch extras;
    ``extra`` is added to the consumer's configuration."""
    out: list[Message] = []
    deadline = time.monotonic() + timeout
    settle: float | None = None
    with reader(bootstrap, topics, **extra) as consumer:
        while time.monotonic() < deadline:
            if settle is not None and time.monotonic() > settle:
                break
            for msg in consumer.consume(1000, 0.2):
                err = msg.error()
                if err is None:
                    out.append(msg)
                elif err.code() != KafkaError._PARTITION_EOF:
                    raise RuntimeError(str(err))
            if len(out) >= count and settle is None:
                settle = time.monotonic() + 1.0
    return out


def consumed_headers(msg: Message) -> list[tuple[str, bytes | None]] | None:
    """``msg.headers()`` of a consumed message: (name, bytes or None) pairs. The client types
    ``headers()`` like the ``headers`` argument of ``produce``, which also accepts a dict and str values."""
    return cast("list[tuple[str, bytes | None]] | None", msg.headers())


def text(data: bytes | None) -> str:
    """A consumed key or value as text; the tests that use it never write a null one."""
    assert data is not None
    return data.decode()


def end_offsets(bootstrap: str, topic: str, partitions: int = 1) -> int:
    c = Consumer({"bootstrap.servers": bootstrap, "group.id": unique("offsets")})
    try:
        return sum(c.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(partitions))
    finally:
        c.close()


def set_topic_config(bootstrap: str, topic: str, name: str, value: str) -> None:
    """Change one topic configuration on the broker (e.g. raise max.message.bytes)."""
    # confluent_kafka.admin imports these from its _config module without re-exporting them
    # explicitly (no __all__, no "as" alias), so mypy's strict no-implicit-reexport rejects the import.
    from confluent_kafka.admin import AlterConfigOpType, ConfigEntry, ConfigResource  # type: ignore[attr-defined]

    admin = AdminClient({"bootstrap.servers": bootstrap})
    resource = ConfigResource(
        ConfigResource.Type.TOPIC,
        topic,
        incremental_configs=[ConfigEntry(name, value, incremental_operation=AlterConfigOpType.SET)],
    )
    for f in admin.incremental_alter_configs([resource]).values():
        f.result(30)

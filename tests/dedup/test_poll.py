"""DedupReader's wrapping of the consumer API, over a scripted consumer (no broker needed)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import cast

import pytest
from confluent_kafka import Consumer, TopicPartition

from harvester.client.dedup import DedupReader
from harvester.core.identity import IdentityHeaders

pytestmark = pytest.mark.unit


@dataclass
class FakeMessage:
    """The subset of ``confluent_kafka.Message`` the reader uses."""

    offset_: int
    key_: bytes | None
    headers_: list[tuple[str, bytes | None]] | None
    error_: object = None
    topic_: str = "t"
    partition_: int = 0

    def error(self) -> object:
        return self.error_

    def topic(self) -> str:
        return self.topic_

    def partition(self) -> int:
        return self.partition_

    def offset(self) -> int:
        return self.offset_

    def key(self) -> bytes | None:
        return self.key_

    def headers(self) -> list[tuple[str, bytes | None]] | None:
        return self.headers_


class FakeConsumer:
    """Hands out a fixed list of messages; records assignments."""

    def __init__(self, messages: list[FakeMessage]) -> None:
        self.messages = messages
        self.assigned: list[TopicPartition] = []

    def poll(self, timeout: float) -> FakeMessage | None:
        return self.messages.pop(0) if self.messages else None

    def consume(self, num_messages: int, timeout: float) -> list[FakeMessage]:
        batch, self.messages = self.messages[:num_messages], self.messages[num_messages:]
        return batch

    def assign(self, partitions: list[TopicPartition]) -> None:
        self.assigned = partitions


def as_consumer(fake: FakeConsumer) -> Consumer:
    """The fake where the reader wants a consumer: it implements the part of the API the reader uses."""
    return cast(Consumer, fake)


def msg(offset: int, rid: int | None, key: bytes | None = b"k", prefix: str = "outbox-") -> FakeMessage:
    headers: list[tuple[str, bytes | None]] | None = (
        None if rid is None else [(f"{prefix}id", str(rid).encode()), (f"{prefix}epoch", b"1")]
    )
    if headers is not None:
        headers.append((f"{prefix}producer", b"p"))
    return FakeMessage(offset, key, headers)


def test_poll_skips_duplicates_and_passes_everything_else() -> None:
    error = FakeMessage(-1, None, None, error_="broker down")
    fake = FakeConsumer([msg(0, 7), msg(1, 7), msg(2, 7), msg(3, None), msg(4, None), error, msg(5, 8)])
    reader = DedupReader(as_consumer(fake))
    offsets = []
    while (m := reader.poll(0.1)) is not None:
        offsets.append(m.offset())
    assert offsets == [0, 3, 4, -1, 5]
    assert reader.duplicates_dropped == 2
    assert reader.positions() == {("t", 0): 6}  # dropped copies count as consumed; errors do not move it
    assert reader.registry.get_sample_value("harvester_dedup_duplicates_dropped_total") == 2


def test_consume_and_a_custom_prefix() -> None:
    fake = FakeConsumer([msg(0, 1, prefix="x-"), msg(1, 1, prefix="x-"), msg(2, 1, prefix="outbox-")])
    reader = DedupReader(as_consumer(fake), headers=IdentityHeaders("x-"))
    # The default-prefixed copy carries no identity under "x-": passed through.
    assert [m.offset() for m in reader.consume(10, 0.1)] == [0, 2]


def test_positions_survive_restore_and_are_applied_on_assignment() -> None:
    first = DedupReader(as_consumer(FakeConsumer([msg(0, 1), msg(1, 2, key=None)])))
    assert len(first.consume(10, 0.1)) == 2
    assert first.offsets() == {"t": {"0": 2}}

    fake = FakeConsumer([msg(2, 1), msg(3, 2, key=None), msg(4, 3, key=None)])
    second = DedupReader(as_consumer(fake))
    second.restore(first.snapshot(), first.offsets())
    second.on_assign(as_consumer(fake), [TopicPartition("t", 0), TopicPartition("t", 1)])
    assert (fake.assigned[0].partition, fake.assigned[0].offset) == (0, 2)
    assert fake.assigned[1].offset < 0  # no saved position: where the group would start
    assert [m.offset() for m in second.consume(10, 0.1)] == [4]

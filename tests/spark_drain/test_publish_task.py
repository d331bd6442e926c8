"""A task of the ``outbox-publish`` sink against the real broker, without Spark: what Kafka refuses
for good is sent again up to the attempts, unless its key moved on, and handed back; the rest is
delivered in order."""

from __future__ import annotations

from collections.abc import Callable

import pytest

from harvester.spark.publish.task import Record, publish
from tests.support.kafka import read_messages, text
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration


def test_refused_records_come_back_after_their_attempts_unless_their_key_moved_on(
    services: Services, topics: Callable[..., str]
) -> None:
    good, missing = topics(), unique("missing")  # the brokers do not create topics here
    epoch: list[tuple[str, bytes | None]] = [("outbox-epoch", b"7")]

    def record(rid: int, topic: str, key: str) -> Record:
        return Record(rid, topic, key, f"{key}:{rid}".encode(), epoch)

    records = [
        record(1, missing, "a"),  # refused; key a's next record is delivered: not sent again
        record(2, good, "a"),
        record(3, missing, "b"),  # refused, nothing of key b after it: sent three times
        record(4, good, "c"),
        record(5, good, "c"),
    ]
    kafka = {"bootstrap.servers": services.bootstrap, "topic.metadata.propagation.max.ms": "1000"}
    outcome = publish(kafka, iter(records), 3, "outbox-epoch")
    refused = outcome.refused

    assert outcome.records == 5
    assert [(r.epoch, r.failure.id, r.failure.attempts) for r in refused] == [(7, 1, 1), (7, 3, 3)]
    # The last attempt's reason, as a reaper records it: the broker's metadata, or librdkafka's
    # local refusal once it knows the topic is missing.
    assert {r.failure.reason for r in refused} <= {"unknown_topic_or_part", "unknown_topic"}
    assert all("nknown topic" in r.failure.error and r.failure.first_failure is not None for r in refused)
    got = read_messages(services.bootstrap, [good], 3)
    assert [text(m.value()) for m in got] == ["a:2", "c:4", "c:5"]


def test_a_task_with_more_records_than_the_producer_queue_holds_sends_them_all(
    services: Services, topics: Callable[..., str]
) -> None:
    # Nothing polls a task's producer but the task: were its reports not served while the queue is
    # full, the task would wait forever at the queue's size (100,000 records by default).
    topic = topics()
    records = (Record(i, topic, f"k{i % 7}", f"v{i}".encode(), [("outbox-epoch", b"1")]) for i in range(1, 501))
    kafka = {"bootstrap.servers": services.bootstrap, "queue.buffering.max.messages": "50"}
    outcome = publish(kafka, records, 3, "outbox-epoch")
    assert outcome.records == 500 and outcome.refused == []
    assert len(read_messages(services.bootstrap, [topic], 500)) == 500

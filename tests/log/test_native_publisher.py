"""The native loop in the harvester's own process (harvester.kafka.native_publisher), on the real
broker: the producer process's tests of what does not concern a child run against it too (records in
publish order with one report each; placements, tombstones and null header values as given, a record
too large failing alone; refused settings failing at start; stamps and librdkafka's logs and errors
are in that module, for every publisher); a close produces what is still queued; and the
at-least-once publisher that keeps order is this one by default where the loop was built, the
producer process when asked or with the Python loop, confluent-kafka's in-process producer with
``producerProcess: false``."""

from __future__ import annotations

import queue
from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harvester.compose import publisher
from harvester.kafka.native_publisher import NativePublisher, PlacingNativePublisher, native_built
from harvester.kafka.process_publisher import ProcessPublisher
from harvester.kafka.publisher import KafkaPublisher, producer_config
from tests.log import test_producer_process as child
from tests.support.kafka import read_messages
from tests.support.services import Services

Reports = child.Reports


@pytest.fixture
def started(services: Services) -> Iterator[Callable[..., tuple[NativePublisher, Reports]]]:
    """Starts a native publisher, with ``placing`` one whose columns carry placements."""
    assert native_built(), "the native loop was not built: see ./dev.sh, .local/native.log"
    made: list[NativePublisher] = []

    def start(placing: bool = False, **producer: Any) -> tuple[NativePublisher, Reports]:
        reports: Reports = queue.SimpleQueue()
        kind = PlacingNativePublisher if placing else NativePublisher
        made.append(kind(producer_config(services.kafka(), producer), reports.put_nowait, in_order=True))
        return made[-1], reports

    yield start
    for made_one in made:
        made_one.close(5)


test_records_land_in_publish_order_with_one_report_each = child.test_records_land_in_publish_order_with_one_report_each
test_placed_records_tombstones_and_null_header_values_land_as_given_and_a_too_large_record_fails_alone = (
    child.test_placed_records_tombstones_and_null_header_values_land_as_given_and_a_too_large_record_fails_alone
)
test_refused_settings_fail_at_start = child.test_refused_settings_fail_at_start


def test_a_close_produces_what_is_still_queued(services: Services, topics: Callable[..., str]) -> None:
    topic = topics(2)
    reports: Reports = queue.SimpleQueue()
    native = NativePublisher(producer_config(services.kafka(), {}), reports.put_nowait, in_order=True)
    native.publish([child._record(n, topic, key=f"k{n % 3}") for n in range(2000)])
    native.close(30)
    done = [reports.get_nowait() for _ in range(reports.qsize())]
    assert sorted(r.id for r, _ in done) == list(range(2000)) and all(err is None for _, err in done)
    assert len(read_messages(services.bootstrap, [topic], 2000)) == 2000


@pytest.mark.parametrize(
    ("producer_process", "loop", "kind"),
    [
        (None, "native", NativePublisher),
        (None, "python", ProcessPublisher),
        (True, "native", ProcessPublisher),
        (False, "native", KafkaPublisher),
    ],
)
def test_the_publisher_that_keeps_order_is_the_native_one_unless_asked_otherwise(
    services: Services,
    monkeypatch: pytest.MonkeyPatch,
    producer_process: bool | None,
    loop: str,
    kind: type[NativePublisher | ProcessPublisher | KafkaPublisher],
) -> None:
    monkeypatch.setenv("HARVESTER_PRODUCER_LOOP", loop)
    chosen = publisher(
        producer_config(services.kafka(), {}), lambda _: None, in_order=True, producer_process=producer_process
    )
    try:
        assert type(chosen) is kind and chosen.keeps_order
    finally:
        chosen.close(5)

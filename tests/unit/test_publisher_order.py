"""Whether the Kafka publisher keeps a key's records in order with several in flight: only an
idempotent producer without a delivery timeout does, and only when the log source asks."""

from __future__ import annotations

from typing import Any

import pytest

from harvester.kafka.publisher import KafkaPublisher, producer_config

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("producer", "ordered"),
    [
        ({}, True),
        ({"delivery.timeout.ms": 0}, True),
        ({"message.timeout.ms": 60000}, False),
        ({"delivery.timeout.ms": "15000"}, False),
        ({"enable.idempotence": False}, False),
        ({"enable.idempotence": "false"}, False),
    ],
)
def test_order_is_kept_by_an_idempotent_producer_without_a_delivery_timeout(
    producer: dict[str, Any], ordered: bool
) -> None:
    config = producer_config({"bootstrap.servers": "127.0.0.1:9"}, producer)  # never reached
    for in_order in (True, False):
        publisher = KafkaPublisher(config, lambda report: None, in_order=in_order)
        try:
            assert publisher.keeps_order is (ordered and in_order)
        finally:
            publisher.close(0)

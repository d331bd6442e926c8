"""ElectorConfig validation."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from leader import ElectorConfig
from leader.clients import consumer_config, producer_config

pytestmark = pytest.mark.unit


def test_topic_defaults_from_group() -> None:
    assert ElectorConfig(group_id="billing").topic == "billing.neli"
    assert ElectorConfig(group_id="billing", topic="t").topic == "t"


def test_defaults_are_goharvest_like() -> None:
    c = ElectorConfig(group_id="g")
    assert (c.heartbeat_timeout, c.min_poll_interval, c.max_poll_interval) == (5.0, 0.1, 300.0)


@pytest.mark.parametrize(
    ("fields", "message"),
    [
        ({"kafka_config": {"group.id": "x"}}, "set by the elector"),
        ({"kafka_config": {"session.timeout.ms": 1000}}, "set by the elector"),
        ({"kafka_config": {"group.instance.id": "static"}}, "set by the elector"),
        ({"heartbeat_interval": 5.0, "heartbeat_timeout": 5.0}, "heartbeat_interval"),
        ({"min_poll_interval": 2.0, "heartbeat_interval": 1.0}, "min_poll_interval"),
        ({"group_heartbeat_interval": 3.0, "session_timeout": 3.0}, "group_heartbeat_interval"),
        ({"heartbeat_timeout": 9.5, "session_timeout": 10.0}, "must be shorter than session_timeout"),
        ({"max_poll_interval": 5.0, "session_timeout": 8.0}, "max_poll_interval"),
        ({"heartbeat_timeout": 0}, "greater than 0"),
    ],
)
def test_inconsistent_settings_are_rejected(fields: dict[str, object], message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        ElectorConfig.model_validate({"group_id": "g", **fields})


def test_shared_client_properties_are_accepted() -> None:
    # A base config shared with the publisher may carry producer settings; the elector overrides its own.
    c = ElectorConfig(group_id="g", kafka_config={"bootstrap.servers": "b:9092", "acks": "1", "enable.auto.commit": 1})
    assert producer_config(c)["acks"] == "all"
    assert consumer_config(c, lambda err, partitions: None)["enable.auto.commit"] is False
    assert consumer_config(c, lambda err, partitions: None)["bootstrap.servers"] == "b:9092"

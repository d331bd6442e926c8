"""Validation of what users configure or write: table names, durations, outbox records."""

from __future__ import annotations

from datetime import timedelta

import pytest
from pydantic import ValidationError

from harvester import HarvesterConfig, IdentifierError, Limits, OutboxRecord, RecordError, TableName
from harvester.core.durations import parse_duration
from harvester.core.records import ColumnLimits

pytestmark = pytest.mark.unit


@pytest.mark.parametrize("text", ["outbox", "app.outbox", "_x1", "A.B"])
def test_table_names_accepted(text: str) -> None:
    assert TableName.parse(text).qualified == text


@pytest.mark.parametrize(
    "text", ["outbox; DROP TABLE x", 'out"box', "a.b.c", "", "1abc", "a-b", "x" * 64, "public.", "o utbox"]
)
def test_table_names_rejected(text: str) -> None:
    with pytest.raises(IdentifierError):
        TableName.parse(text)


def test_injection_in_config_is_a_config_error() -> None:
    with pytest.raises(ValidationError, match="invalid table name"):
        HarvesterConfig(outbox_table="outbox; DROP TABLE users")


@pytest.mark.parametrize(
    ("text", "seconds"), [("100ms", 0.1), ("5s", 5), ("1m30s", 90), ("1.5s", 1.5), ("250us", 0.00025), (2, 2)]
)
def test_durations(text: object, seconds: float) -> None:
    assert parse_duration(text) == timedelta(seconds=seconds)


@pytest.mark.parametrize("text", ["5", "fast", "-1s", "5 s", "s", -3, True])
def test_bad_durations(text: object) -> None:
    if text == "5":
        assert parse_duration("0") == timedelta(0)  # only the bare zero is unit-less, as in Go
        text = "5x"
    with pytest.raises(ValueError, match="duration"):
        parse_duration(text)


def test_goharvest_keys_and_snake_case_are_equivalent() -> None:
    a = HarvesterConfig.model_validate(
        {
            "dataSource": "host=x",
            "outboxTable": "o",
            "leaderGroupID": "g",
            "limits": {"maxInFlightRecords": 5, "markBackoff": "20ms"},
        }
    )
    b = HarvesterConfig(
        data_source="host=x",
        outbox_table="o",
        leader_group_id="g",
        limits=Limits.model_validate({"max_in_flight_records": 5, "mark_backoff": "20ms"}),
    )
    assert a.model_dump(exclude={"name"}) == b.model_dump(exclude={"name"})
    assert a.topic == "g.neli"


@pytest.mark.parametrize(
    ("text", "size"), [("512MiB", 512 << 20), ("2GB", 2 * 10**9), (65536, 65536), ("1GiB", 1 << 30)]
)
def test_log_transaction_memory_sizes(text: object, size: int) -> None:
    assert HarvesterConfig.model_validate({"logTransactionMemory": text}).log_transaction_memory == size


@pytest.mark.parametrize(
    ("text", "message"), [("lots", "invalid size 'lots'"), ("5 parsecs", "invalid size"), (0, "greater than 0")]
)
def test_bad_log_transaction_memory(text: object, message: str) -> None:
    with pytest.raises(ValidationError, match=message):
        HarvesterConfig.model_validate({"logTransactionMemory": text})


def test_negative_limit_rejected() -> None:
    with pytest.raises(ValidationError, match=r"max_in_flight_records|maxInFlightRecords"):
        HarvesterConfig.model_validate({"limits": {"maxInFlightRecords": -1}})


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [
        ({"topic": "bad topic", "key": "k"}, "invalid Kafka topic"),
        ({"topic": "..", "key": "k"}, "invalid Kafka topic"),
        ({"topic": "t" * 250, "key": "k"}, "invalid Kafka topic"),
        ({"topic": "t", "key": "k", "header_keys": ("a",), "header_values": ()}, "header"),
        ({"topic": "t", "key": "k\x00"}, "NUL"),
    ],
)
def test_record_rejected_before_database(kwargs: dict[str, object], message: str) -> None:
    with pytest.raises((RecordError, ValidationError), match=message):
        OutboxRecord(**kwargs)  # type: ignore[arg-type]


def test_record_checked_against_column_limits() -> None:
    goharvest = ColumnLimits()
    with pytest.raises(RecordError, match="key has 101"):
        OutboxRecord(topic="t", key="k" * 101).check_limits(goharvest)
    with pytest.raises(RecordError, match="value has 10001"):
        OutboxRecord(topic="t", key="k", value="v" * 10001).check_limits(goharvest)
    with pytest.raises(RecordError, match="UTF-8"):
        OutboxRecord(topic="t", key="k", value=b"\xff").check_limits(goharvest)
    OutboxRecord(topic="t", key="k", value=b"\xff" * 20000).check_limits(ColumnLimits(value_kind="bytes"))

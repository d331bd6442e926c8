"""The table-less outbox's payload format: what a stasher encodes, the log source decodes, and a
payload that is not a record of a known version is refused (so dead-lettered, not published)."""

from __future__ import annotations

import pytest

from harvester import OutboxRecord
from harvester.postgres.schema import message_format
from harvester.postgres.schema.message_format import PayloadError, decode, encode


@pytest.mark.parametrize(
    "record",
    [
        OutboxRecord.of("orders", "k", "v"),
        OutboxRecord.of("orders", "", None),  # a tombstone, an empty key
        OutboxRecord.of("t", "ключ", b"\x00\xff" * 200, {"a": "1", "b": "é"}),  # lengths past one varint byte
    ],
)
def test_a_record_survives_the_round_trip(record: OutboxRecord) -> None:
    payload = encode(record)
    assert payload[0] == message_format.VERSION
    value = record.value.encode() if isinstance(record.value, str) else record.value
    headers = list(zip(record.header_keys, record.header_values, strict=True))
    assert decode(payload) == (record.topic, record.key, value, headers)


@pytest.mark.parametrize(
    ("payload", "why"),
    [
        (b"", "empty"),
        (b"\x02\x01t\x01k\x00\x00", "version 2"),
        (encode(OutboxRecord.of("t", "k", "value"))[:-3], "truncated"),
        (encode(OutboxRecord.of("t", "k", "v")) + b"x", "bytes after"),
        (b"\x01\x01\xff\x01k\x00\x00", "UTF-8"),
    ],
)
def test_what_is_not_a_record_is_refused(payload: bytes, why: str) -> None:
    with pytest.raises(PayloadError, match=why):
        decode(payload)


@pytest.mark.parametrize("size", [0, 126, 127, 128, 16_382, 16_383, 16_384])
def test_values_around_the_length_bytes_boundaries_decode_alike(size: int) -> None:
    """A value's length takes one uvarint byte below 127 bytes, two below 16,383: both ways of
    reading (inline for the usual payload, field by field for any) give the same record."""
    for record in (OutboxRecord.of("t", "k", b"v" * size), OutboxRecord.of("t" * 130, "k", b"v" * size, {"h": "1"})):
        payload = encode(record)
        expected = (record.topic, "k", b"v" * size, list(zip(record.header_keys, record.header_values, strict=True)))
        assert decode(payload) == message_format._by_fields(payload) == expected
        with pytest.raises(PayloadError, match="truncated"):
            decode(payload[:-1])

"""The table-less outbox's wire format: one outbox record as the payload of a transactional logical
decoding message, ``pg_logical_emit_message(true, <prefix>, <payload>)``, which the stashers write in
the application's transaction and the log source reads from the slot (docs/log-source.md).

The prefix names the outbox (default ``harvester:<schema>.<table>``), so several outboxes share a
database and its slot readers skip the others' messages. The payload, version 1::

    version  1 byte, 0x01
    topic    uvarint length, then the topic in UTF-8
    key      uvarint length, then the key in UTF-8
    value    uvarint (length + 1), 0 for a tombstone (no value); then the value's bytes
    headers  uvarint count, then per header: uvarint length and the key in UTF-8,
             uvarint length and the value in UTF-8

A uvarint is an unsigned LEB128 integer (7 bits a byte, low bits first, high bit set on every byte but
the last). A reader refuses another version, and a payload that does not parse, as malformed: the
record goes to the dead-letter table with its raw payload. A later version keeps the first byte as its
number; readers that know it accept every earlier one.
"""

from __future__ import annotations

from harvester.core.records import OutboxRecord
from harvester.postgres.schema.identifiers import TableName

VERSION = 1


class PayloadError(ValueError):
    """A payload that is not a record of a version this reader knows."""


def default_prefix(table: TableName) -> str:
    """The prefix of the table-less outbox named like ``table``."""
    return f"harvester:{table.qualified}"


def _uvarint(n: int, out: bytearray) -> None:
    while n > 0x7F:
        out.append((n & 0x7F) | 0x80)
        n >>= 7
    out.append(n)


def _text(text: str, out: bytearray) -> None:
    data = text.encode("utf-8")
    _uvarint(len(data), out)
    out += data


def encode(record: OutboxRecord) -> bytes:
    """``record`` as a version 1 payload."""
    out = bytearray((VERSION,))
    _text(record.topic, out)
    _text(record.key, out)
    value = record.value
    if value is None:
        out.append(0)
    else:
        data = value.encode("utf-8") if isinstance(value, str) else value
        _uvarint(len(data) + 1, out)
        out += data
    _uvarint(len(record.header_keys), out)
    for key, text in zip(record.header_keys, record.header_values, strict=True):
        _text(key, out)
        _text(text, out)
    return bytes(out)


def _uvarint_at(data: bytes, at: int) -> tuple[int, int]:
    """The uvarint at ``data[at]`` and where the next field starts."""
    if at >= len(data):
        raise PayloadError("truncated payload")
    byte = data[at]
    if byte < 0x80:  # one byte: every length below 128
        return byte, at + 1
    n, shift = byte & 0x7F, 7
    for i in range(at + 1, min(len(data), at + 10)):
        byte = data[i]
        n |= (byte & 0x7F) << shift
        if byte < 0x80:
            return n, i + 1
        shift += 7
    raise PayloadError("truncated or overlong length")


def _text_at(data: bytes, at: int) -> tuple[str, int]:
    size, at = _uvarint_at(data, at)
    end = at + size
    if end > len(data):
        raise PayloadError("truncated payload")
    try:
        return data[at:end].decode("utf-8"), end
    except UnicodeDecodeError:
        raise PayloadError("text that is not UTF-8") from None


Decoded = tuple[str, str, bytes | None, list[tuple[str, str]]]


def decode(payload: bytes) -> Decoded:
    """(topic, key, value, headers) of a payload; :class:`PayloadError` if it is not one."""
    if not payload:
        raise PayloadError("empty payload")
    if payload[0] != VERSION:
        raise PayloadError(f"payload version {payload[0]}, this reader knows {VERSION}")
    try:
        usual = _usual(payload)
    except (IndexError, UnicodeDecodeError):
        usual = None
    return usual if usual is not None else _by_fields(payload)


def _usual(payload: bytes) -> Decoded | None:
    """The usual payload read inline, without a call per field (once per record of a table-less
    burst): topic and key shorter than 128 bytes, a value shorter than 16 KiB, no headers. None for
    another payload, or one that does not add up: :func:`_by_fields` reads it, or says what is wrong."""
    size = payload[1]
    if size >= 0x80:
        return None
    at = 2 + size
    topic = payload[2:at]
    size = payload[at]
    if size >= 0x80:
        return None
    key = payload[at + 1 : at + 1 + size]
    at += 1 + size
    size, width = payload[at], 1
    if size >= 0x80:  # a two-byte length
        high = payload[at + 1]
        if high >= 0x80:
            return None
        size, width = (size & 0x7F) | high << 7, 2
    at += width
    value = payload[at : at + size - 1] if size else None
    at += max(size - 1, 0)
    if at + 1 != len(payload) or payload[at] != 0:
        return None
    return topic.decode("utf-8"), key.decode("utf-8"), value, []


def _by_fields(payload: bytes) -> Decoded:
    # Fields read by offset, without a reader object.
    topic, at = _text_at(payload, 1)
    key, at = _text_at(payload, at)
    size, at = _uvarint_at(payload, at)
    value: bytes | None = None
    if size:
        value, at = payload[at : at + size - 1], at + size - 1
        if at > len(payload):
            raise PayloadError("truncated payload")
    count, at = _uvarint_at(payload, at)
    headers: list[tuple[str, str]] = []
    for _ in range(count):
        name, at = _text_at(payload, at)
        text, at = _text_at(payload, at)
        headers.append((name, text))
    if at != len(payload):
        raise PayloadError("bytes after the record")
    return topic, key, value, headers

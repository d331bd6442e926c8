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
from harvester.postgres.identifiers import TableName

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


class _Reader:
    __slots__ = ("at", "data")

    def __init__(self, data: bytes) -> None:
        self.data, self.at = data, 1

    def uvarint(self) -> int:
        n, shift = 0, 0
        while True:
            if self.at >= len(self.data) or shift > 63:
                raise PayloadError("truncated or overlong length")
            byte = self.data[self.at]
            self.at += 1
            n |= (byte & 0x7F) << shift
            if byte < 0x80:
                return n
            shift += 7

    def take(self, size: int) -> bytes:
        end = self.at + size
        if end > len(self.data):
            raise PayloadError("truncated payload")
        chunk, self.at = self.data[self.at : end], end
        return chunk

    def text(self) -> str:
        try:
            return self.take(self.uvarint()).decode("utf-8")
        except UnicodeDecodeError:
            raise PayloadError("text that is not UTF-8") from None


Decoded = tuple[str, str, bytes | None, list[tuple[str, str]]]


def decode(payload: bytes) -> Decoded:
    """(topic, key, value, headers) of a payload; :class:`PayloadError` if it is not one."""
    if not payload:
        raise PayloadError("empty payload")
    if payload[0] != VERSION:
        raise PayloadError(f"payload version {payload[0]}, this reader knows {VERSION}")
    reader = _Reader(payload)
    topic = reader.text()
    key = reader.text()
    size = reader.uvarint()
    value = reader.take(size - 1) if size else None
    headers = [(reader.text(), reader.text()) for _ in range(reader.uvarint())]
    if reader.at != len(payload):
        raise PayloadError("bytes after the record")
    return topic, key, value, headers

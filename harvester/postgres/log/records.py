"""What an outbox insert read from the log becomes: the record the engine publishes, from the
column values of a pgoutput Insert message in their binary forms (each type's send format) and
where, and of which type, the outbox's columns are in its Relation message.

Called once per record at full speed. The layout ``reaper migrate`` and goharvest create (the
published columns in their order, a bigint id, non-NULL id, create_time, topic and key, no headers)
is read by :func:`_usual`: one struct call for the fixed-width head, then the key's and the value's
lengths; or, when it was built (``deploy/native/build.sh``, run by ``./dev.sh`` and the image), by
its C twin in ``_usual_insert.c``, which makes no Python object but the record's fields, and
takes a streamed transaction's inserts straight from the stream's copy data (streamed.py)
(``HARVESTER_INSERT_DECODER=python`` keeps the Python one). Any other row of a supported layout
takes :func:`_any`, column by column; all give the same record (``tests/log/test_decoding.py``)."""

from __future__ import annotations

import os
import struct
from datetime import UTC, datetime, timedelta
from typing import TYPE_CHECKING

from harvester.core.protocols import StoreError
from harvester.core.records import MarkedRecord
from harvester.postgres.log import pgoutput
from harvester.postgres.table import rows

if TYPE_CHECKING:
    from harvester.postgres.log._usual_insert import Decoder as NativeDecoder

# The columns a record is made of (the log source publishes and reads no other).
PUBLISHED = ("id", "create_time", "kafka_topic", "kafka_key", "kafka_value", "kafka_header_keys", "kafka_header_values")

# Type oids (PostgreSQL's pg_type.dat) the log source reads, grouped by their binary form.
_INTEGERS = frozenset({20, 23, 21})  # bigint, integer, smallint: big-endian two's complement
_TIMESTAMPS = frozenset({1184, 1114})  # timestamptz, timestamp: int64 microseconds since 2000-01-01
_TEXTS = frozenset({25, 1043, 1042, 19, 114})  # text, varchar, char, name, json: the text's UTF-8 bytes
_JSONB = 3802  # a version byte (1), then the text
_BYTEA = 17  # the bytes
# Arrays of _TEXTS, by their elements' type: dimensions, a has-NULLs flag, the element type, each
# dimension's length and lower bound, then each element's length (-1: NULL) and bytes.
_ELEMENTS = {1009: 25, 1015: 1043, 1014: 1042, 1003: 19, 199: 114}
_TEXT_ARRAYS = frozenset(_ELEMENTS)
_READABLE: dict[str, frozenset[int]] = {
    "id": _INTEGERS,
    "create_time": _TIMESTAMPS,
    "kafka_topic": _TEXTS,
    "kafka_key": _TEXTS,
    "kafka_value": _TEXTS | {_JSONB, _BYTEA},
    "kafka_header_keys": _TEXT_ARRAYS,
    "kafka_header_values": _TEXT_ARRAYS,
}
READABLE_TYPES = (
    "a bigint, integer or smallint id, a timestamptz or timestamp create_time, text-typed (text, varchar)"
    " kafka_topic and kafka_key, a text, varchar, json, jsonb or bytea kafka_value, and text[] header columns"
)

_I32 = struct.Struct("!i")
_U32 = struct.Struct("!I")
_ARRAY_HEAD = struct.Struct("!iii")
# The usual layout's head: the column count, then id and create_time (kind 'b', length 8, value),
# then the topic's kind and length.
_HEAD = struct.Struct("!6xHcIqcIqcI")
_HEAD_BINARY = (b"b", 8, b"b", 8, b"b")
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_INSERT_VALUES = 8  # 'I', the relation's oid, 'N', the column count


def readable(column: str, type_oid: int) -> bool:
    """Whether the log source reads ``column`` (one of :data:`PUBLISHED`) of type ``type_oid``."""
    return type_oid in _READABLE[column]


class Columns:
    """Where the outbox's columns are in a Relation message's tuple, and how to read them."""

    def __init__(self, relation: pgoutput.Relation) -> None:
        index = {name: i for i, name in enumerate(relation.columns)}
        try:
            at = [index[c] for c in PUBLISHED]
        except KeyError as exc:
            raise StoreError(f"the published outbox has no column {exc.args[0]}") from None
        for column, i in zip(PUBLISHED, at, strict=True):
            if not readable(column, relation.types[i]):
                raise StoreError(
                    f"the log source cannot read {column} of type oid {relation.types[i]}: it reads {READABLE_TYPES}"
                )
        self.id, self.time, self.topic, self.key, self.value, self.hkeys, self.hvalues = at
        self.needed = 1 + max(at)
        self.jsonb = relation.types[self.value] == _JSONB
        self.usual = at == list(range(len(PUBLISHED))) and relation.types[0] == 20
        # The two header columns' values when both are empty arrays (no dimensions), by their
        # element types' oids.
        empty = (_ARRAY_HEAD.pack(0, 0, _ELEMENTS[relation.types[i]]) for i in (self.hkeys, self.hvalues))
        self.no_headers = b"".join(b"b" + _I32.pack(12) + e for e in empty)
        # The last create_time read, as sent and as a datetime: the rows of one transaction usually
        # share it (DEFAULT now()). Only the mark thread decodes, so no lock.
        self.last_time: tuple[int | None, datetime] = (None, _EPOCH)
        self.native = _native(self) if self.usual else None


def _native(c: Columns) -> NativeDecoder | None:
    """The C decoder of the usual rows, unless it was not built or ``HARVESTER_INSERT_DECODER`` asks
    for the Python one."""
    if os.environ.get("HARVESTER_INSERT_DECODER", "native") != "native":
        return None
    try:
        from harvester.postgres.log._usual_insert import Decoder
    except ImportError:
        return None
    return Decoder(MarkedRecord, c.no_headers, c.jsonb, _EPOCH)


def outbox_record(data: bytes, c: Columns) -> MarkedRecord:
    """The record of an Insert message, before the identity headers."""
    if data[5] != 0x4E:  # 'N'
        raise pgoutput.ProtocolError("an insert without its new tuple")
    if c.usual:
        record = c.native.decode(data) if c.native is not None else _usual(data, c)
        if record is not None:
            return record
    return _any(data, c)


def _usual(data: bytes, c: Columns) -> MarkedRecord | None:
    """The record of a usual row (see the module's docstring), or None for another, or for a
    message too short for the lengths it gives (:func:`_any` reads it, or says what is wrong)."""
    end = len(data)
    if end < _HEAD.size:
        return None
    _, k_id, n_id, rid, k_time, n_time, micros, k_topic, size = _HEAD.unpack_from(data)
    at = _HEAD.size + size
    # A NULL among the four, or lengths past the message's end.
    if (k_id, n_id, k_time, n_time, k_topic) != _HEAD_BINARY or at + 5 > end or data[at] != 0x62:
        return None
    topic = data[_HEAD.size : at].decode()
    (size,) = _U32.unpack_from(data, at + 1)
    at += 5 + size
    if at >= end:
        return None
    key = data[at - size : at].decode()
    value: bytes | None = None
    if data[at] == 0x62:
        if at + 5 > end:
            return None
        (size,) = _U32.unpack_from(data, at + 1)
        at += 5 + size
        if at > end:
            return None
        value = data[at - size : at]
    else:
        at += 1
    if not data.startswith(c.no_headers, at):
        return None
    if c.jsonb and value is not None:
        value = value[1:]
    return MarkedRecord(rid, _time(c, micros), topic, key, value, [])


def _any(data: bytes, c: Columns) -> MarkedRecord:
    values = pgoutput.tuple_values(data, _INSERT_VALUES, c.needed)
    raw_id, raw_time, raw_topic, key, value = (values[i] for i in (c.id, c.time, c.topic, c.key, c.value))
    if c.jsonb and value is not None:
        value = value[1:]
    try:
        hkeys, hvalues = _elements(values[c.hkeys]), _elements(values[c.hvalues])
        why = rows.malformed("", hkeys, hvalues)
    except ValueError as exc:
        hkeys = hvalues = None
        why = str(exc)
    headers: list[tuple[str, str | bytes | None]] = [
        (k.decode() if k is not None else "", v if v is not None else b"")
        for k, v in zip(hkeys or (), hvalues or (), strict=False)
    ]
    if key is None:
        why = rows.malformed(None, [], [])
    return MarkedRecord(
        int.from_bytes(raw_id or b"", signed=True),
        _time(c, None if raw_time is None else int.from_bytes(raw_time, signed=True)),
        (raw_topic or b"").decode(),
        key.decode() if key is not None else "",
        value,
        headers,
        malformed=why,
    )


def _time(c: Columns, micros: int | None) -> datetime:
    """A create_time as sent (microseconds since 2000-01-01), or now for NULL and infinity."""
    if micros is None:
        return datetime.now(UTC)
    last, when = c.last_time
    if micros == last:
        return when
    try:
        when = _EPOCH + timedelta(microseconds=micros)
    except OverflowError:  # 'infinity' or '-infinity': now, each time (not kept)
        return datetime.now(UTC)
    c.last_time = (micros, when)
    return when


def _elements(raw: bytes | None) -> list[bytes | None] | None:
    """The elements of a one-dimensional array in its binary form (None for a NULL element); None
    for a NULL array. Raises ValueError for more dimensions."""
    if raw is None:
        return None
    dimensions, _, _ = _ARRAY_HEAD.unpack_from(raw)
    if dimensions == 0:
        return []
    if dimensions != 1:
        raise ValueError("header arrays have more than one dimension")
    (count,) = _I32.unpack_from(raw, _ARRAY_HEAD.size)
    at = _ARRAY_HEAD.size + 8  # after the length and lower bound
    out: list[bytes | None] = []
    for _ in range(count):
        (size,) = _I32.unpack_from(raw, at)
        at += 4
        if size < 0:
            out.append(None)
        else:
            out.append(raw[at : at + size])
            at += size
    return out

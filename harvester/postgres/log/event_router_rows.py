"""What an insert into a table of Debezium's outbox layout becomes, read from the log: the record
Debezium's ``EventRouter`` makes of it (:mod:`harvester.event_router`), from the column values of a
pgoutput Insert message in their binary forms.

The record's id (what the identity headers, the dead-letter table and the checkpoints carry) is the
event id column's value when it is an integer, else a 63-bit hash of its bytes: the same in every
term, as the slot sends the same inserts again."""

from __future__ import annotations

import hashlib
import re
import struct
from collections.abc import Container, Mapping
from datetime import UTC, datetime
from uuid import UUID

from harvester.core.protocols import StoreError
from harvester.core.records import MarkedRecord, PlacedRecord
from harvester.event_router import EventRouter
from harvester.postgres.log import pgoutput
from harvester.postgres.log.records import Columns

# Type oids (PostgreSQL's pg_type.dat), by how their binary form reads as text.
_INTEGERS = {20: struct.Struct("!q"), 23: struct.Struct("!i"), 21: struct.Struct("!h")}
_MICROS, _PARTITION = _INTEGERS[20], _INTEGERS[23]
_TEXTS = frozenset({25, 1043, 1042, 19, 114})  # text, varchar, char, name, json: the text's UTF-8
_JSONB, _BYTEA, _UUID, _BOOL, _INT4 = 3802, 17, 2950, 16, 23
_TIMESTAMPS = frozenset({1114, 1184})  # timestamp, timestamptz: microseconds since 2000-01-01 UTC
_INFINITIES = (-(1 << 63), (1 << 63) - 1)  # PostgreSQL's -infinity and infinity
_PARTITIONS = frozenset({_INT4})  # EventRouter reads a partition as an INT32: not smallint, not bigint
_PLACEMENT = "table.fields.additional.placement"
_TEXTUAL = frozenset(_INTEGERS) | _TEXTS | {_JSONB, _UUID, _BOOL}
_INSERT_VALUES = 8  # 'I', the relation's oid, 'N', the column count
_EPOCH = datetime(2000, 1, 1, tzinfo=UTC)
_EPOCH_MICROS = 946_684_800_000_000  # 2000-01-01 after 1970-01-01, in microseconds
_ID_BITS = (1 << 63) - 1
# java.util.Properties text: a key ends at its first unescaped '=' or ':'; '\\x' stands for x.
_SEPARATOR = re.compile(r"(?<!\\)[=:]")
_ESCAPE = re.compile(r"\\(.)")


def _text(raw: bytes, oid: int) -> bytes:
    """A value as Debezium's string converters print it, in UTF-8."""
    if oid in _TEXTS:
        return raw
    if oid == _JSONB:
        return raw[1:]  # a version byte, then the text
    if oid == _UUID:
        return str(UUID(bytes=raw)).encode()
    if oid == _BOOL:
        return b"true" if raw == b"\x01" else b"false"
    return str(_INTEGERS[oid].unpack(raw)[0]).encode()


Role = tuple[str, str, frozenset[int]]  # a column, the option naming it, the type oids it may have


def roles(router: EventRouter, columns: Container[str]) -> list[Role]:
    """The columns EventRouter reads of a table with ``columns``: id, key, payload, route, then the
    placed headers, the timestamp and the partition, those of the table's they may be."""
    # Without table.fields.additional.error.on.missing, EventRouter skips a placement whose column
    # the table lacks.
    optional = not router.additional_error_on_missing
    out: list[Role] = [
        (router.event_id, "table.field.event.id", _TEXTUAL),
        (router.event_key, "table.field.event.key", _TEXTUAL),
        (router.event_payload, "table.field.event.payload", _TEXTUAL | {_BYTEA}),
        (router.route_by_field, "route.by.field", _TEXTUAL),
        *((p.column, _PLACEMENT, _TEXTUAL) for p in router.headers if not optional or p.column in columns),
    ]
    if router.event_timestamp is not None:
        out.append((router.event_timestamp, "table.field.event.timestamp", _TIMESTAMPS))
    partition = router.partition
    if partition is not None and (not optional or partition in columns):
        out.append((partition, _PLACEMENT + " partition", _PARTITIONS))
    return out


def unreadable(role: Role, types: Mapping[str, int], table: str) -> str | None:
    """Why ``role`` cannot be read of a table whose columns have ``types`` (their oids), if it cannot."""
    column, option, readable = role
    if column not in types:
        return f"the outbox table {table} has no column {column} ({option})"
    if types[column] not in readable:
        kinds = "timestamp or timestamptz" if readable is _TIMESTAMPS else "integer" if readable is _PARTITIONS else ""
        need = f": it must be {kinds}" if kinds else ""
        return f"the log source cannot read {column} ({option}) of type oid {types[column]}{need}"
    return None


class RouterColumns(Columns):
    """Where the columns EventRouter reads are in a Relation message's tuple, and their types."""

    def __init__(self, relation: pgoutput.Relation, router: EventRouter) -> None:
        index = {name: i for i, name in enumerate(relation.columns)}
        read = roles(router, index)
        types = {name: relation.types[i] for name, i in index.items()}
        for role in read:
            why = unreadable(role, types, f"{relation.schema}.{relation.name}")
            if why is not None:
                raise StoreError(why)
        self.types = relation.types
        self.event_id, self.key, self.payload, self.route = (index[r[0]] for r in read[:4])
        self.placed = [(p.header, index[p.column]) for p in router.headers if p.column in index]
        self.timestamp = None if router.event_timestamp is None else index[router.event_timestamp]
        partition = router.partition
        self.partition = None if partition is None or partition not in index else index[partition]
        self.places = self.timestamp is not None or self.partition is not None
        # The tracing span context column, when the table has one of a text type (optional, as it is
        # to EventRouter): its W3C trace context is carried as the record's.
        tracing = index.get(router.tracing_span_context_field)
        self.tracing = tracing if tracing is not None and relation.types[tracing] in _TEXTS else None
        at = [index[r[0]] for r in read]
        self.needed = 1 + max(at if self.tracing is None else [*at, self.tracing])
        self.integer_id = self.types[self.event_id] in _INTEGERS
        self.tombstones = router.route_tombstone_on_empty_payload
        self.router = router.router()
        self.topics: dict[str, str] = {}  # the routed topic of each route.by.field value seen


def router_record(data: bytes, c: RouterColumns, created: datetime = _EPOCH) -> MarkedRecord:
    """The record EventRouter makes of an Insert message, before the identity headers."""
    if data[5] != 0x4E:  # 'N'
        raise pgoutput.ProtocolError("an insert without its new tuple")
    values = pgoutput.tuple_values(data, _INSERT_VALUES, c.needed)
    types = c.types
    raw_id, raw_key, payload, raw_route = (values[i] for i in (c.event_id, c.key, c.payload, c.route))
    why: str | None = None
    if raw_id is None:
        why, rid, id_text = "the event id is NULL", 0, b""
    else:
        id_text = _text(raw_id, types[c.event_id])
        if c.integer_id:
            rid = int(id_text)
        else:
            rid = int.from_bytes(hashlib.blake2b(raw_id, digest_size=8).digest()) & _ID_BITS
    key = "" if raw_key is None else _text(raw_key, types[c.key]).decode()
    if raw_key is None:
        why = why or "the event key is NULL"
    topic = ""
    if raw_route is None:
        why = why or "the route.by.field value is NULL"
    else:
        value = _text(raw_route, types[c.route]).decode()
        topic = c.topics.get(value) or c.topics.setdefault(value, c.router.topic(value))
    if payload is not None and types[c.payload] != _BYTEA:
        payload = _text(payload, types[c.payload])
        if c.tombstones and not payload.strip():
            payload = None
    headers: list[tuple[str, str | bytes | None]] = [("id", id_text)]
    for name, i in c.placed:
        raw = values[i]
        headers.append((name, None if raw is None else _text(raw, types[i])))
    if c.tracing is not None and values[c.tracing] is not None:
        headers += trace_context(values[c.tracing] or b"")
    if not c.places:
        return MarkedRecord(rid, created, topic, key, payload, headers, malformed=why)
    timestamp, partition, unplaceable = _placement(values, c)
    why = why or unplaceable
    return PlacedRecord(
        rid, created, topic, key, payload, headers, malformed=why, timestamp=timestamp, partition=partition
    )


def _placement(values: list[bytes | None], c: RouterColumns) -> tuple[int, int, str | None]:
    """A row's timestamp (milliseconds, 0: the producer's clock) and partition (-1: the partitioner's),
    and why they cannot be a record's. EventRouter's timestamp is the column's in milliseconds
    (Java's division, toward zero), its partition the column's; a NULL leaves either to the relay
    (Debezium's timestamp is then when it processed the change)."""
    timestamp, partition, why = 0, -1, None
    raw = None if c.timestamp is None else values[c.timestamp]
    if raw is not None:
        micros = _MICROS.unpack(raw)[0]
        since_1970 = micros + _EPOCH_MICROS
        timestamp = since_1970 // 1000 if since_1970 >= 0 else -(-since_1970 // 1000)
        if micros in _INFINITIES or timestamp < 0:
            why = "the event timestamp is not a time Kafka takes (before 1970, or infinite)"
            timestamp = 0
    raw = None if c.partition is None else values[c.partition]
    if raw is not None:
        partition = _PARTITION.unpack(raw)[0]
        if partition < 0:
            why = why or f"the partition column's value {partition} is negative"
            partition = -1
    return timestamp, partition, why


def trace_context(properties: bytes) -> list[tuple[str, str | bytes | None]]:
    """The ``traceparent`` and ``tracestate`` of a tracing span context column, which Debezium's
    writers fill with ``java.util.Properties.store`` text (``key=value`` lines, ``#`` comments,
    backslash escapes)."""
    out: list[tuple[str, str | bytes | None]] = []
    for raw in properties.decode("utf-8", "replace").splitlines():
        line = raw.strip()
        if not line or line[0] in "#!":
            continue
        parts = _SEPARATOR.split(line, maxsplit=1)
        key, value = (_unescape(p).strip() for p in [*parts, ""][:2])
        if key in ("traceparent", "tracestate") and value:
            out.append((key, value.encode()))
    return out


def _unescape(text: str) -> str:
    return _ESCAPE.sub(lambda m: m.group(1), text)

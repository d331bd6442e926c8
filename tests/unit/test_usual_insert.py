"""The usual layout's decoder in C (``_usual_insert.c``) against the Python one on Insert messages
built by hand, edge cases a real server seldom sends: each gives the same record, or both leave the
message to the general path, or both raise the same error. tests/log/test_decoding.py compares them
on a real server's messages."""

from __future__ import annotations

import dataclasses
import functools
import struct
from collections.abc import Callable
from datetime import UTC, datetime

import pytest

from harvester.core.records import MarkedRecord
from harvester.postgres.log import pgoutput
from harvester.postgres.log.records import PUBLISHED, Columns, outbox_record

TYPES = {"text": 25, "jsonb": 3802, "bytea": 17}
EMPTY_TEXT_ARRAY = struct.pack("!iii", 0, 0, 25)
NOW = datetime(2026, 1, 1, tzinfo=UTC)  # stands for a create_time read as now


def relation(value_type: str) -> pgoutput.Relation:
    return pgoutput.Relation(16384, "s", "outbox", PUBLISHED, (20, 1184, 1043, 1043, TYPES[value_type], 1009, 1009))


def column(value: bytes | None) -> bytes:
    return b"n" if value is None else b"b" + struct.pack("!I", len(value)) + value


def insert(
    *,
    rid: int = 7,
    micros: int = 123_456_789,
    topic: bytes = b"t",
    key: bytes | None = b"k",
    value: bytes | None = b"v",
    headers: bytes = column(EMPTY_TEXT_ARRAY) * 2,
) -> bytes:
    head = b"I" + struct.pack("!I", 16384) + b"N" + struct.pack("!H", 7)
    fixed = column(struct.pack("!q", rid)) + column(struct.pack("!q", micros))
    return head + fixed + column(topic) + column(key) + column(value) + headers


def decoders(monkeypatch: pytest.MonkeyPatch, value_type: str) -> tuple[Columns, Columns, Columns]:
    """Columns decoding with the C decoder, with the Python one, and column by column."""
    native = Columns(relation(value_type))
    assert native.native is not None, "the native decoder was not built: see ./dev.sh, .local/native.log"
    monkeypatch.setenv("HARVESTER_INSERT_DECODER", "python")
    python, general = Columns(relation(value_type)), Columns(relation(value_type))
    assert python.native is None
    general.usual = False
    return native, python, general


def outcome(decode: Callable[[], MarkedRecord]) -> MarkedRecord | str:
    """The record, its fields but a create_time of now (infinity) the same, or that it raised (which
    error depends on where the path found the message short)."""
    try:
        record = decode()
    except Exception:
        return "raised"
    if abs((record.create_time - datetime.now(UTC)).total_seconds()) < 60:
        return dataclasses.replace(record, create_time=NOW)
    return record


CASES = {
    "plain": insert(),
    "a NULL value": insert(value=None),
    "an empty value": insert(value=b""),
    "text past ASCII": insert(topic="tö".encode(), key="ключ".encode(), value="ü".encode()),
    "a negative id, time before 2000": insert(rid=-5, micros=-86_400_000_001),
    "infinity": insert(micros=2**63 - 1),
    "-infinity": insert(micros=-(2**63)),
    "headers": insert(headers=column(struct.pack("!iiiii", 1, 0, 25, 1, 1) + struct.pack("!i", 1) + b"h") * 2),
    "a NULL key": insert(key=None),
    "a key that is not UTF-8": insert(key=b"\xff"),
    "cut in the head": insert()[:30],
    "cut in the topic": insert(topic=b"topic")[:42],
    "cut in the value": insert(value=b"value")[:-40],
    "cut in the headers": insert()[:-3],
    "a topic longer than the message": insert()[:35] + struct.pack("!I", 2**32 - 1) + insert()[39:],
    "a key longer than the message": insert(key=b"")[:40] + struct.pack("!I", 2**32 - 1) + column(EMPTY_TEXT_ARRAY) * 2,
    "a value longer than the message": insert(value=b"")[:47] + struct.pack("!I", 2**31) + column(EMPTY_TEXT_ARRAY) * 2,
    "a row of NULLs, shorter than the usual head": b"I"
    + struct.pack("!I", 16384)
    + b"N"
    + struct.pack("!H", 7)
    + column(struct.pack("!q", 7))
    + b"n" * 6,
}


@pytest.mark.parametrize("value_type", sorted(TYPES))
@pytest.mark.parametrize("case", sorted(CASES))
def test_the_c_decoder_gives_what_the_python_one_does(
    monkeypatch: pytest.MonkeyPatch, value_type: str, case: str
) -> None:
    message = CASES[case]
    native, python, general = decoders(monkeypatch, value_type)
    results = [outcome(functools.partial(outbox_record, message, c)) for c in (native, python, general)]
    assert results[0] == results[1] == results[2]
    if case in ("plain", "a NULL value", "text past ASCII", "a negative id, time before 2000"):
        assert native.native is not None and native.native.decode(message) == results[1]  # not left to the general path


def test_a_transaction_s_rows_share_their_create_time(monkeypatch: pytest.MonkeyPatch) -> None:
    native, _, _ = decoders(monkeypatch, "text")
    assert native.native is not None
    first, second, third = (native.native.decode(insert(micros=m)) for m in (5, 5, 6))
    assert first is not None and second is not None and third is not None
    assert first.create_time is second.create_time and third.create_time != first.create_time


def test_a_jsonb_value_loses_its_version_byte(monkeypatch: pytest.MonkeyPatch) -> None:
    native, python, _ = decoders(monkeypatch, "jsonb")
    message = insert(value=b'\x01{"a": 1}')
    assert native.native is not None
    record = native.native.decode(message)
    assert record is not None and record.value == b'{"a": 1}' and record == outbox_record(message, python)


HEAD = 25  # the XLogData head before a message ('w', two LSNs, a time)
XID, OTHER_XID, OID = struct.pack("!I", 9), struct.pack("!I", 10), struct.pack("!I", 16384)


def copy_data(message: bytes, xid: bytes = XID) -> bytes:
    """A streamed change as the copy data brings it: the head, then the message with its xid."""
    return b"w" + bytes(HEAD - 1) + message[:1] + xid + message[1:]


def test_the_c_decoder_takes_streamed_inserts_from_the_copy_data_until_it_meets_another(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    """``take_streamed`` (streamed.py's native take): each usual insert of the xid and the table,
    decoded as ``decode`` does the message without its xid, costed at its size without the xid; it
    stops at another subtransaction's, another table's, a row the general path reads, a message
    that is not an insert and a keepalive, and leaves those to its caller."""
    native, _, _ = decoders(monkeypatch, "text")
    assert native.native is not None
    plain, empty = insert(rid=1), insert(rid=2, value=b"")
    raw: list[bytes | memoryview] = [copy_data(plain), memoryview(copy_data(empty))]
    stops = {
        "another subtransaction's": copy_data(insert(), OTHER_XID),
        "another table's": copy_data(insert()[:1] + struct.pack("!I", 16385) + insert()[5:]),
        "a row with headers": copy_data(CASES["headers"]),
        "a row cut short": copy_data(CASES["cut in the value"]),
        "a Relation": copy_data(b"R" + OID + b"s\0outbox\0d\0\0"),
        "a keepalive": b"k" + bytes(17),
    }
    for why, stop in stops.items():
        changes: list[object] = []
        end, cost = native.native.take_streamed([*raw, stop, *raw], 0, HEAD, XID, OID, changes, 10**6, 500)
        assert (end, len(changes)) == (2, 2), why
        assert changes == [native.native.decode(plain), native.native.decode(empty)]
        assert cost == len(plain) + len(empty) + 2 * 500
    changes = []
    assert native.native.take_streamed(raw, 1, HEAD, XID, OID, changes, 10**6, 0) == (2, len(empty))  # from start


def test_the_c_decoder_stops_taking_once_past_the_room_it_was_given(monkeypatch: pytest.MonkeyPatch) -> None:
    native, _, _ = decoders(monkeypatch, "text")
    assert native.native is not None
    message = insert()
    raw: list[bytes | memoryview] = [copy_data(message)] * 5
    each = len(message) + 100
    for room, taken in ((-1, 0), (0, 1), (each - 1, 1), (each, 2), (4 * each, 5)):
        changes: list[object] = []
        assert native.native.take_streamed(raw, 0, HEAD, XID, OID, changes, room, 100) == (taken, taken * each)
        assert len(changes) == taken

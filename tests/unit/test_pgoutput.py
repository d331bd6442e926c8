"""pgoutput's messages and tuples, byte for byte (tests/log/test_decoding.py decodes real ones)."""

from __future__ import annotations

import struct

import pytest

from harvester.postgres.log import pgoutput

pytestmark = pytest.mark.unit


def test_relation_insert_and_commit() -> None:
    relation = (
        b"R" + struct.pack("!I", 42) + b"s\0outbox\0d" + struct.pack("!H", 2)
        + b"\x01id\0" + struct.pack("!Ii", 20, -1) + b"\x00kafka_key\0" + struct.pack("!Ii", 25, -1)
    )  # fmt: skip
    assert pgoutput.parse(relation) == pgoutput.Relation(42, "s", "outbox", ("id", "kafka_key"), (20, 25))
    insert = b"I" + struct.pack("!I", 42) + b"N" + struct.pack("!H", 2) + b"b" + struct.pack("!iq", 8, 7) + b"n"
    assert pgoutput.tuple_values(insert, 8, 2) == [struct.pack("!q", 7), None]
    assert pgoutput.tuple_values(insert, 8, 1) == [struct.pack("!q", 7)]  # only the columns asked for
    assert pgoutput.parse(insert) is None  # the log source knows its outbox's inserts before parsing
    with pytest.raises(pgoutput.ProtocolError, match="'t'"):  # a text value: the stream did not ask for binary
        pgoutput.tuple_values(b"t" + struct.pack("!i", 1) + b"7", 0, 1)
    commit = b"C\0" + struct.pack("!QQq", 0x10, 0x1_0000_0020, 0)
    assert pgoutput.parse(commit) == pgoutput.Commit(0x10, 0x1_0000_0020)
    assert pgoutput.parse(b"D" + b"\0" * 8) is None  # deletes are not the log source's business


def test_lsn_round_trip() -> None:
    assert pgoutput.lsn_text(0x16_B374D848) == "16/B374D848"
    assert pgoutput.lsn_value("16/B374D848") == 0x16_B374D848

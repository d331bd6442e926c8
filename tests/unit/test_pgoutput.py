"""pgoutput's messages and array text forms, byte for byte (the log source's tests decode real ones)."""

from __future__ import annotations

import struct

import pytest

from harvester.postgres import pgoutput

pytestmark = pytest.mark.unit


def test_relation_insert_and_commit() -> None:
    relation = (
        b"R" + struct.pack("!I", 42) + b"s\0outbox\0d" + struct.pack("!H", 2)
        + b"\x01id\0" + struct.pack("!Ii", 20, -1) + b"\x00kafka_key\0" + struct.pack("!Ii", 25, -1)
    )  # fmt: skip
    assert pgoutput.parse(relation) == pgoutput.Relation(42, "s", "outbox", ("id", "kafka_key"))
    insert = b"I" + struct.pack("!I", 42) + b"N" + struct.pack("!H", 2) + b"t" + struct.pack("!i", 1) + b"7n"
    assert pgoutput.parse(insert) == pgoutput.Insert(42, [b"7", None])
    assert pgoutput.insert_values(insert, 1) == [b"7"]  # only the columns asked for
    commit = b"C\0" + struct.pack("!QQq", 0x10, 0x1_0000_0020, 0)
    assert pgoutput.parse(commit) == pgoutput.Commit(0x10, 0x1_0000_0020)
    assert pgoutput.parse(b"D" + b"\0" * 8) is None  # deletes are not the log source's business


def test_text_arrays() -> None:
    assert pgoutput.text_array(None) is None
    assert pgoutput.text_array("{}") == []
    assert pgoutput.text_array('{a,"b c",NULL,"NULL","x\\"y\\\\z",""}') == ["a", "b c", None, "NULL", 'x"y\\z', ""]


def test_lsn_round_trip() -> None:
    assert pgoutput.lsn_text(0x16_B374D848) == "16/B374D848"
    assert pgoutput.lsn_value("16/B374D848") == 0x16_B374D848

"""The consumer protocol's member assignment, as ``reaper status`` reads it (leader.members)."""

from __future__ import annotations

import struct

import pytest

from leader.members import assignment

pytestmark = pytest.mark.unit


def _encoded(version: int, topics: dict[str, list[int]], user_data: bytes = b"") -> bytes:
    out = struct.pack("!hi", version, len(topics))
    for topic, partitions in topics.items():
        name = topic.encode()
        out += struct.pack("!h", len(name)) + name + struct.pack("!i", len(partitions))
        out += b"".join(struct.pack("!i", p) for p in partitions)
    return out + struct.pack("!i", len(user_data)) + user_data


@pytest.mark.parametrize("version", [0, 1, 3])
def test_an_assignment_names_each_topics_partitions(version: int) -> None:
    data = _encoded(version, {"leader": [0, 2], "other": [1]}, user_data=b"sticky")
    assert assignment(data) == {"leader": [0, 2], "other": [1]}


def test_no_or_foreign_data_is_no_assignment() -> None:
    assert assignment(None) == {}
    assert assignment(b"") == {}
    assert assignment(struct.pack("!hi", 0, 5) + b"\x00\x40abc") == {}  # truncated

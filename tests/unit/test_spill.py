"""The log source's spill file: messages appended, read back by position one at a time or as a
run, and cut back."""

from __future__ import annotations

import pytest

from harvester.postgres.spill import Spill

pytestmark = pytest.mark.unit


def test_messages_come_back_by_position_and_a_cut_forgets_the_later_ones() -> None:
    spill = Spill()
    try:
        messages = [b"", b"I" * 3, bytes(range(256)), b"x"]
        for m in messages:
            spill.append(m)
        assert len(spill) == 4
        assert [spill.read(i, i + 1)[0] for i in range(4)] == messages
        assert spill.read(1, 4) == messages[1:] and spill.read(2, 2) == []
        with pytest.raises(IndexError):
            spill.read(4, 5)
        spill.truncate(2)
        spill.append(b"after")
        assert spill.read(0, 3) == [b"", b"III", b"after"]
    finally:
        spill.close()

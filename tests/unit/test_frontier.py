"""The frontier's bookkeeping alone: when an id counts as settled, and when a mark may move the
frontier (the interleavings a real server gives rarely; tests/engine/test_frontier.py has those
it gives on demand)."""

from __future__ import annotations

import uuid

from harvester.postgres.table.frontier import Settling
from harvester.postgres.table.marks import FIRST_ID, HandedOut

LEADER = uuid.uuid4()


def test_ids_seen_with_no_writer_are_settled_at_once() -> None:
    s = Settling()
    s.seen(100, [])
    assert s.settled == 100


def test_ids_seen_with_writers_wait_until_they_are_gone() -> None:
    s = Settling()
    s.seen(100, ["3/7"])
    assert s.settled == FIRST_ID
    s.seen(200, ["3/7", "4/1"])  # 3/7 still there: 100 is not settled yet
    assert s.settled == FIRST_ID
    s.seen(250, ["4/1", "5/2"])  # 3/7 gone: 100 is, but 200 was seen with 4/1 too
    assert s.settled == 100
    s.seen(260, ["5/2", "6/3"])  # 4/1 gone: 200 is, 250 waits for 5/2
    assert s.settled == 200
    s.seen(270, ["6/3"])  # 5/2 gone, 6/3 was found after 260 too
    assert s.settled == 250
    s.seen(FIRST_ID, [])
    assert s.settled == 270


def test_waiting_on_many_reads_keeps_the_newest() -> None:
    s = Settling()
    for i in range(1, 100):
        s.seen(i, ["9/9", f"1/{i}"])  # one writer outlives every read
    assert s.settled == FIRST_ID
    s.seen(100, ["2/1"])
    assert s.settled == 99


def test_a_mark_moves_the_frontier_past_what_it_handed_out() -> None:
    h = HandedOut()
    skip = h.exclude(LEADER)
    assert skip.start == FIRST_ID and skip.ids == []
    h.add(LEADER, [1, 2, 3, 4])
    h.advance(LEADER, skip, 3)
    assert h.start == 3
    assert h.exclude(LEADER).ids == [3, 4]
    assert sorted(h.exclude(LEADER, sweep=True).ids) == [1, 2, 3, 4]
    assert h.exclude(LEADER, sweep=True).start == FIRST_ID


def test_a_release_during_a_mark_keeps_the_frontier_where_it_was() -> None:
    h = HandedOut()
    h.exclude(LEADER)
    h.add(LEADER, [1, 2, 3])
    skip = h.exclude(LEADER)  # the mark skips 1, 2 and 3
    h.released([2])  # meanwhile 2 failed: the mark did not hand it out again
    h.advance(LEADER, skip, 4)
    assert h.start == FIRST_ID
    assert h.exclude(LEADER).ids == [1, 3]


def test_a_release_behind_the_frontier_moves_it_back() -> None:
    h = HandedOut()
    skip = h.exclude(LEADER)
    h.add(LEADER, list(range(1, 11)))
    h.advance(LEADER, skip, 11)
    h.released([7, 4])
    assert h.start == 4
    assert h.exclude(LEADER).ids == [5, 6, 8, 9, 10]


def test_a_new_leader_id_looks_from_the_start() -> None:
    h = HandedOut()
    skip = h.exclude(LEADER)
    h.add(LEADER, [1, 2])
    h.advance(LEADER, skip, 3)
    other = uuid.uuid4()
    again = h.exclude(other)
    assert again.start == FIRST_ID and again.ids == []
    h.advance(LEADER, skip, 10)  # the old leader id's mark: ignored
    assert h.start == FIRST_ID

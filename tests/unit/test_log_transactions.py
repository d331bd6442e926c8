"""The log source's bookkeeping of received transactions, from pgoutput messages built byte for
byte: records go out as they arrive, before their Commit; a transaction settles only once its Commit
came; a stream restarted in the middle of a transaction skips what was received before; a
transaction's done prefix is what a new term skips of it, and a done record counts as durable only
once a stored position covers it."""

from __future__ import annotations

import struct
import time
from uuid import UUID, uuid4

import pytest

from harvester.postgres.log.records import PUBLISHED
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import SPILLED
from harvester.postgres.log.transactions import Transactions, messages, reached

pytestmark = pytest.mark.unit

OID = 42


def begin(final_lsn: int, xid: int = 7, commit_time: int = 0) -> bytes:
    return b"B" + struct.pack("!QqI", final_lsn, commit_time, xid)


def commit(commit_lsn: int, end_lsn: int) -> bytes:
    return b"C\0" + struct.pack("!QQq", commit_lsn, end_lsn, 0)


def relation() -> bytes:
    types = (20, 1184, 1043, 1043, 1043, 1009, 1009)  # as 'reaper migrate' creates them
    columns = b"".join(
        b"\x00" + name.encode() + b"\0" + struct.pack("!Ii", oid, -1)
        for name, oid in zip(PUBLISHED, types, strict=True)
    )
    return b"R" + struct.pack("!I", OID) + b"s\0outbox\0d" + struct.pack("!H", len(PUBLISHED)) + columns


def insert(rid: int) -> bytes:
    empty = struct.pack("!iii", 0, 0, 25)
    values = [struct.pack("!q", rid), struct.pack("!q", 0), b"t", b"k", b"v", empty, empty]
    body = b"".join(b"b" + struct.pack("!i", len(v)) + v for v in values)
    return b"I" + struct.pack("!I", OID) + b"N" + struct.pack("!H", len(values)) + body


def outbox() -> Transactions:
    return Transactions(b"I", OID.to_bytes(4, "big"), 1, OID)


def test_records_go_out_before_the_commit_and_settle_after_it() -> None:
    txns, leader = outbox(), uuid4()
    txns.start_pass(leader)
    txns.receive([begin(100), relation(), insert(1), insert(2)])
    assert txns.receiving and txns.waiting == 2
    taken = txns.take(leader, 10)
    txn = taken[0][0]
    assert txn.end_lsn == 0 and not reached([txn], 10**9)
    assert txns.handed_out(taken, [1, 2]) == set()
    txns.completed([1, 2], 0)
    assert not txn.settled and txns.settled(0) == 0  # all done, but more may come
    txns.receive([insert(3), commit(100, 120)])
    assert not txns.receiving and txns.waiting == 1 and txn.end_lsn == 120
    assert txns.handed_out([(txn, 2)], [3]) == set()
    txns.completed([3], 0)
    assert reached([txn], 120) and txns.settled(0) == 120


def test_the_oldest_age_is_the_commit_time_of_the_oldest_transaction_not_all_done() -> None:
    txns, leader = outbox(), uuid4()
    txns.start_pass(leader)
    now = int((time.time() - 946_684_800) * 1e6)  # microseconds since 2000-01-01, as pgoutput sends it
    assert txns.oldest_age() is None
    txns.receive([begin(100, commit_time=now - 60_000_000), relation(), insert(1), commit(100, 110)])
    txns.receive([begin(200, commit_time=now - 5_000_000), insert(2)])  # its Commit still to come
    hand_out(txns, leader, [1, 2])
    assert 60 <= (txns.oldest_age() or 0) < 120
    txns.completed([1], 0)
    assert 5 <= (txns.oldest_age() or 0) < 60  # the first settled; the second is not done
    txns.completed([2], 0)
    assert 5 <= (txns.oldest_age() or 0) < 60  # done, but its Commit has not come yet
    txns.receive([commit(200, 210)])
    assert txns.oldest_age() is None


def test_a_restarted_stream_skips_what_came_before() -> None:
    txns, leader = outbox(), uuid4()
    txns.start_pass(leader)
    txns.receive([begin(80), relation(), insert(0), commit(80, 99)])  # the one before, whole
    txns.receive([begin(100), relation(), insert(1), insert(2)])
    assert txns.waiting == 3
    txns.stream_started()  # the server sends the transaction again from its Begin, after one before
    txns.receive([begin(80), insert(0), commit(80, 99), begin(100), relation(), insert(1)])
    txns.receive([insert(2), insert(3), commit(100, 120)])
    first, txn = txns.kept
    assert len(first.inserts) == 1 and len(txn.inserts) == 3 and txn.end_lsn == 120
    assert txns.waiting == 4  # nothing twice


def test_a_transaction_a_restarted_stream_sends_again_is_skipped_across_reads() -> None:
    """However the reads cut what a restarted stream sends before the half-received transaction, none
    of it is the open one's: a skipped transaction's Commit taken for the open one's moved the term's
    received end back, and every transaction after it came in again (exactly once, duplicates)."""
    txns, leader = outbox(), uuid4()
    txns.start_pass(leader)
    txns.receive([begin(60), relation(), insert(0), commit(60, 79), begin(80), insert(1), commit(80, 99)])
    txns.receive([begin(100), relation(), insert(2)])
    hand_out(txns, leader, [0, 1, 2])
    txns.stream_started()
    txns.receive([begin(60), relation(), insert(0)])
    txns.receive([commit(60, 79), begin(80), insert(1)])
    txns.receive([commit(80, 99), begin(100), relation(), insert(2), insert(3), commit(100, 120)])
    assert [(t.commit_lsn, len(t.inserts), t.end_lsn) for t in txns.kept] == [(60, 1, 79), (80, 1, 99), (100, 2, 120)]
    assert txns.waiting == 1  # record 3: nothing twice


def test_a_half_received_transaction_the_stream_skips_holds_the_slot() -> None:
    """Cannot happen with a slot not confirmed past it; should it, nothing moves past it."""
    txns, leader = outbox(), uuid4()
    txns.start_pass(leader)
    txns.receive([begin(100), relation(), insert(1)])
    txns.stream_started()
    txns.receive([begin(130), insert(2), commit(130, 150)])
    half, whole = txns.kept
    assert half.end_lsn == 0 and whole.end_lsn == 150
    assert txns.handed_out(txns.take(leader, 10), [1, 2]) == set()
    assert txns.completed([1, 2], 0) == 0  # the slot stays before the half-received one


def test_a_batch_goes_out_but_its_records_recovered_or_gone() -> None:
    """A record completed before this term handed it out (recovered) and one whose row is gone are
    done at hand-out: their ids come back, and only the others are in flight."""
    txns, leader = outbox(), uuid4()
    txns.start_pass(leader)
    txns.receive([begin(100), relation(), *(insert(rid) for rid in range(1, 6)), commit(100, 110)])
    assert txns.completed([2], 0) == 0  # not handed out yet: recovered
    assert txns.handed_out(txns.take(leader, 5), range(1, 6), gone={4}) == {2, 4}
    assert txns.in_flight() == {1, 3, 5}
    assert txns.completed([1, 3, 5], 0) == 110


def hand_out(txns: Transactions, leader: UUID, rids: list[int]) -> None:
    taken = txns.take(leader, len(rids))
    assert txns.handed_out(taken, rids) == set()


def test_the_done_prefix_stops_at_the_first_record_not_done() -> None:
    txns, leader = outbox(), uuid4()
    txns.start_pass(leader)
    txns.receive([begin(100), relation(), *(insert(r) for r in range(1, 6))])
    hand_out(txns, leader, [1, 2, 3, 4, 5])
    assert txns.partial() == (0, 0)
    txns.completed([2, 3, 5], 0)
    assert txns.partial() == (0, 0)  # record 1 is not done
    txns.completed([1], 0)
    assert txns.partial() == (100, 3)  # 1, 2, 3; not 4
    txns.completed([4], 0)
    assert txns.partial() == (100, 5)  # all received so far; more may come before the Commit


def test_a_new_term_skips_the_stored_prefix_of_its_transaction() -> None:
    txns, leader = outbox(), uuid4()
    txns.new_term(done_upto=90, partial=(100, 2))
    txns.start_pass(leader)
    txns.receive([begin(80), relation(), insert(0), commit(80, 90)])  # done: skipped whole
    txns.receive([begin(100), relation(), *(insert(r) for r in (1, 2, 3)), commit(100, 120)])
    assert txns.waiting == 1
    hand_out(txns, leader, [3])
    assert txns.completed([3], 0) == 120


def test_a_done_record_is_durable_once_a_stored_position_covers_it() -> None:
    txns, leader = outbox(), uuid4()
    txns.follow_durable()
    txns.start_pass(leader)
    txns.receive([begin(100), relation(), *(insert(r) for r in (1, 2, 3)), commit(100, 120)])
    txns.receive([begin(130), relation(), insert(4), commit(130, 150)])
    hand_out(txns, leader, [1, 2, 3, 4])
    txns.completed([2, 4], 0)
    assert txns.durable([2, 4], 0, txns.partial()) == []  # record 1 is not done: nothing stored
    txns.completed([1], 0)
    assert txns.partial() == (100, 2)
    assert txns.durable([1], 0, (100, 2)) == [1, 2]  # 2 kept back before; 4's transaction is after 3
    assert txns.completed([3], 0) == 150
    assert txns.durable([3], 150, (0, 0)) == [3, 4]
    assert txns.durable([4], 150, (0, 0)) == [4]  # forgotten once returned: no longer followed


def test_inserts_past_the_memory_limit_are_spilled_and_read_back_by_every_pass() -> None:
    budget, first, second = Budget(500), uuid4(), uuid4()
    txns = Transactions(b"I", OID.to_bytes(4, "big"), 1, OID, budget)
    txns.start_pass(first)
    txns.receive([begin(100), relation(), *(insert(rid) for rid in range(1, 11)), commit(100, 110)])
    txn = txns.kept[0]
    spill = txn.spill
    assert spill is not None and len(txn.inserts) == 4 and txn.size == 10  # an insert counts 86 + 80 bytes
    assert budget.received == txn.in_memory == 4 * 166
    assert messages([(txn, i) for i in range(10)]) == [insert(rid) for rid in range(1, 11)]
    taken = txns.take(first, 100)
    assert [i for _, i in taken] == list(range(10))
    assert messages(taken) == [insert(rid) for rid in range(1, 11)]  # the spilled ones in one read
    assert txns.handed_out(taken, [i + 1 for _, i in taken]) == set()
    txns.completed([2, 8], 0)  # one in memory, one spilled
    txns.start_pass(second)  # a new pass hands out what is not done, from memory and the spill
    again = txns.take(second, 100)
    assert [i for _, i in again] == [0, 2, 3, 4, 5, 6, 8, 9]
    assert txns.handed_out(again, [i + 1 for _, i in again]) == set()
    assert txns.completed([i + 1 for _, i in again], 0) == 110 and not txns.kept and budget.received == 0
    with pytest.raises(ValueError, match="closed file"):  # settled: its spill is removed
        spill.read(0, 1)


def test_a_new_term_removes_the_spills_of_what_it_forgets() -> None:
    budget = Budget(100)
    txns = Transactions(b"I", OID.to_bytes(4, "big"), 1, OID, budget)
    txns.receive([begin(100), relation(), *(insert(rid) for rid in range(1, 5))])  # half received
    spill = txns.kept[0].spill
    assert spill is not None and len(spill) > 0
    txns.new_term()
    assert budget.received == 0
    with pytest.raises(ValueError, match="closed file"):
        spill.read(0, 1)


def test_a_streamed_transaction_spills_where_its_stream_did_and_a_restarted_one_later_keeps_what_it_decoded() -> None:
    """What the stream decoded stays in memory, counted by the stream, whose count the transaction
    takes over at its Begin: it spills where the stream's SPILLED marker says. A restarted stream
    whose limit came later gives decoded records past where the spill began: they are kept apart,
    by index."""
    budget, leader = Budget(10**9), uuid4()
    txns = Transactions(b"I", OID.to_bytes(4, "big"), 1, OID, budget)
    txns.start_pass(leader)
    decoded = [("decoded", rid) for rid in range(1, 4)]
    budget.handed = 3 * 600  # as the stream handed it over at the commit
    txns.receive([begin(100), relation(), *decoded, SPILLED, insert(4), insert(5)])
    txn = txns.kept[0]
    assert txn.inserts == decoded and txn.spill is not None and len(txn.spill) == 2
    assert budget.handed == 0 and budget.received == txn.in_memory == 1800
    txns.stream_started()  # the stream broke; the next one decoded up to the fourth
    txns.receive([begin(100), relation(), *decoded, ("decoded", 4), ("decoded", 5), ("decoded", 6), SPILLED])
    txns.receive([insert(7), commit(100, 110)])
    assert messages([(txn, i) for i in range(7)]) == [*decoded, insert(4), insert(5), ("decoded", 6), insert(7)]
    taken = txns.take(leader, 100)
    assert [i for _, i in taken] == list(range(7))
    assert messages(taken) == [*decoded, insert(4), insert(5), ("decoded", 6), insert(7)]


def test_the_received_transactions_share_one_budget_and_a_small_one_never_spills() -> None:
    """Each of two transactions is under the limit, together they are not: the second spills once
    it is past the floor; a small one keeps its inserts in memory however far over the sum is; a
    settled one gives its count back. A stream's count handed over for a transaction received before
    (sent again by a restarted stream, skipped) is dropped."""
    budget, leader = Budget(700, floor=300), uuid4()  # an insert counts 86 + 80 bytes
    txns = Transactions(b"I", OID.to_bytes(4, "big"), 1, OID, budget)
    txns.start_pass(leader)
    txns.receive([begin(100), relation(), *(insert(rid) for rid in range(1, 4)), commit(100, 110)])
    txns.receive([begin(200), *(insert(rid) for rid in range(4, 8)), commit(200, 210)])
    txns.receive([begin(300), insert(8), commit(300, 310)])
    first, second, small = txns.kept
    assert first.spill is None and small.spill is None and second.spill is not None
    assert (len(second.inserts), len(second.spill)) == (2, 2)  # the 2nd made it 830 > 700, past 300
    assert budget.received == 6 * 166
    taken = txns.take(leader, 100)
    assert messages(taken) == [insert(rid) for rid in range(1, 9)]
    assert txns.handed_out(taken, range(1, 9)) == set()
    assert txns.completed([1, 2, 3], 0) == 110 and budget.received == 3 * 166
    budget.handed = 1000
    txns.receive([begin(100), insert(1), commit(100, 110)])  # received before: skipped
    assert budget.handed == 0 and budget.received == 3 * 166
    assert txns.completed(list(range(4, 9)), 0) == 310 and budget.received == 0 and not txns.kept

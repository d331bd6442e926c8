"""Streamed transactions put back together, from pgoutput protocol 2 messages built byte for byte:
a Stream Commit gives the Begin, the changes without their xids and the Commit that the walsender
sends for a transaction it did not stream, in chunks; an aborted transaction gives nothing, and an
aborted subtransaction drops its changes and what came after them. (tests/log/test_streaming.py
runs the same against a real server.)"""

from __future__ import annotations

import struct
from collections.abc import Callable

import pytest

from harvester.postgres.log import pgoutput
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import SPILLED, ChangeDecoder, FastInserts, Received, StreamedTransactions

pytestmark = pytest.mark.unit


def start(xid: int, first: bool = False) -> bytes:
    return b"S" + struct.pack("!Ib", xid, first)


STOP = b"E"


def change(xid: int, text: str) -> bytes:
    """An Insert of a streamed transaction: its kind, its (sub)transaction's xid, then the rest."""
    return b"I" + struct.pack("!I", xid) + text.encode()


def stream_commit(xid: int, commit_lsn: int, end_lsn: int) -> bytes:
    return b"c" + struct.pack("!IbQQq", xid, 0, commit_lsn, end_lsn, 99)


def stream_abort(xid: int, sub: int) -> bytes:
    return b"A" + struct.pack("!II", xid, sub)


def given(streamed: StreamedTransactions, limit: int = 1000) -> list[Received]:
    out: list[Received] = []
    while streamed.ready:
        streamed.give(out, limit)
    return out


def given_bytes(streamed: StreamedTransactions) -> list[bytes]:
    """:func:`given`, with no decoder: every message is bytes."""
    out = given(streamed)
    assert all(isinstance(m, bytes) for m in out)
    return [m for m in out if isinstance(m, bytes)]


def feed(streamed: StreamedTransactions, *messages: bytes) -> None:
    for m in messages:
        streamed.take(m)


def test_a_committed_stream_gives_what_an_unstreamed_transaction_would_be() -> None:
    s = StreamedTransactions()
    feed(s, start(7, True), change(7, "a"), STOP, start(8, True), change(8, "x"), STOP, start(7), change(7, "b"), STOP)
    assert s.in_progress == 2 and not s.ready
    feed(s, stream_commit(7, 1000, 1010))
    out = given_bytes(s)
    assert out[1:-1] == [b"Ia", b"Ib"]
    assert pgoutput.parse(out[0]) == pgoutput.Begin(1000, 7, 99)
    assert pgoutput.parse(out[-1]) == pgoutput.Commit(1000, 1010)
    assert s.in_progress == 1


def test_a_large_commit_is_given_in_chunks_and_messages_outside_a_stream_block_are_not_taken() -> None:
    s = StreamedTransactions()
    feed(s, start(7, True), *(change(7, str(i)) for i in range(10)), STOP)
    assert not s.active
    feed(s, stream_commit(7, 1000, 1010))
    out: list[Received] = []
    s.give(out, 5)
    assert len(out) == 5 and s.ready
    s.give(out, 100)
    assert len(out) == 12 and not s.ready


def test_an_aborted_transaction_gives_nothing() -> None:
    s = StreamedTransactions()
    feed(s, start(7, True), change(7, "a"), STOP, stream_abort(7, 7))
    assert s.in_progress == 0 and not s.ready


def test_an_aborted_subtransaction_drops_its_changes_and_what_followed_them() -> None:
    s = StreamedTransactions()
    # 8 is a subtransaction of 7, 9 one of 8 (nested savepoints); 8 aborts, with 9 in it.
    feed(s, start(7, True), change(7, "a"), change(8, "b"), change(9, "c"), STOP, stream_abort(7, 8))
    feed(s, start(7), change(10, "d"), STOP, stream_abort(7, 11))  # 11 streamed nothing: no change
    feed(s, stream_commit(7, 1000, 1010))
    assert given_bytes(s)[1:-1] == [b"Ia", b"Id"]


def test_a_commit_of_a_transaction_whose_changes_were_all_filtered_gives_an_empty_one() -> None:
    s = StreamedTransactions()
    feed(s, stream_commit(5, 1000, 1010))
    out = given_bytes(s)
    assert [m[:1] for m in out] == [b"B", b"C"]


class Decoding:
    """A stream decoder of a test: a function, with no native take of inserts."""

    fast: tuple[FastInserts, bytes] | None = None

    def __init__(self, decode: Callable[[bytes], object | None]) -> None:
        self._decode = decode

    def __call__(self, change: bytes) -> object | None:
        return self._decode(change)


def test_a_decoder_keeps_what_it_returns_instead_of_a_change_one_decoder_per_transaction_and_not_on_errors() -> None:
    made: list[list[bytes]] = []

    def decoder() -> ChangeDecoder:
        seen: list[bytes] = []
        made.append(seen)

        def decode(change: bytes) -> object | None:
            seen.append(change)
            if change.endswith(b"?"):
                raise ValueError("cannot decode")
            return ("decoded", change) if change.endswith(b"!") else None

        return Decoding(decode)

    s = StreamedTransactions(decoder)
    feed(s, start(7, True), change(7, "a!"), change(8, "b!"), STOP, start(9, True), change(9, "x!"), STOP)
    feed(s, start(7), change(7, "c"), change(7, "e?"), change(10, "d!"), STOP, stream_abort(7, 10))
    feed(s, stream_commit(7, 1000, 1010))
    # 10's change dropped; the one the decoder failed on kept as it came.
    assert given(s)[1:-1] == [("decoded", b"Ia!"), ("decoded", b"Ib!"), b"Ic", b"Ie?"]
    assert made == [[b"Ia!", b"Ib!", b"Ic", b"Ie?", b"Id!"], [b"Ix!"]]  # each in its transaction's order


def test_changes_past_the_memory_limit_are_spilled_as_they_came_and_given_in_order() -> None:
    def decoder() -> ChangeDecoder:
        return Decoding(lambda change: ("decoded", change))

    # A decoded change counts its size and 500 bytes (spill.py): the second outgrows 1,000, the third
    # and later ones are spilled, as they came.
    budget = Budget(1000)
    s = StreamedTransactions(decoder, budget)
    feed(s, start(7, True), change(7, "a"), change(7, "b"), change(7, "c"), change(8, "d"), change(8, "e"), STOP)
    feed(s, start(7), change(9, "f"), change(7, "g"), STOP, stream_abort(7, 9))  # cut back inside the spill
    feed(s, stream_commit(7, 1000, 1010))
    assert (budget.streamed, budget.handed) == (0, 2 * (2 + 500))  # its receiver takes its count over
    out: list[Received] = []
    while s.ready:
        s.give(out, 2)  # chunks across the memory part, the spill and the Commit
    assert out[1:-1] == [("decoded", b"Ia"), ("decoded", b"Ib"), SPILLED, b"Ic", b"Id", b"Ie"]
    assert [m[:1] for m in (out[0], out[-1]) if isinstance(m, bytes)] == [b"B", b"C"]


def test_an_aborted_subtransaction_that_began_in_memory_drops_the_spill() -> None:
    budget = Budget(200)  # a change "Ix" counts 2 + 80 bytes: the third one outgrows 200
    s = StreamedTransactions(budget=budget)
    feed(s, start(7, True), change(7, "a"), change(8, "b"), change(8, "c"), change(8, "d"), STOP)
    feed(s, stream_abort(7, 8))
    assert budget.streamed == 82  # "Ia" only
    feed(s, start(7), change(7, "e"), change(7, "f"), change(7, "g"), change(7, "h"), STOP)
    feed(s, stream_commit(7, 1000, 1010))
    assert given_bytes(s)[1:-1] == [b"Ia", b"Ie", b"If", SPILLED, b"Ig", b"Ih"]  # memory again, then spilled


def test_a_stream_closed_removes_its_spills() -> None:
    budget = Budget(100)
    s = StreamedTransactions(budget=budget)
    feed(s, start(7, True), *(change(7, str(i)) for i in range(5)), STOP, start(8, True), change(8, "x"), STOP)
    spill = s._open[7].spill
    assert spill is not None and len(spill) == 3
    s.close()
    assert s.in_progress == 0 and budget.streamed == 0
    with pytest.raises(ValueError, match="closed file"):
        spill.read(0, 1)


def test_the_transactions_in_progress_share_one_budget_and_a_small_one_never_spills() -> None:
    """Each of two interleaved transactions stays under the limit, together they do not: the one
    that outgrows it (past the floor) spills; a transaction under the floor keeps its changes in
    memory however far over the sum is. An aborted transaction gives its count back."""
    budget = Budget(500, floor=200)  # a change "Ix" counts 2 + 80 bytes
    s = StreamedTransactions(budget=budget)
    feed(s, start(7, True), *(change(7, c) for c in "abc"), STOP)  # 246: in memory
    feed(s, start(8, True), *(change(8, c) for c in "def"), STOP)  # 492: in memory
    feed(s, start(9, True), change(9, "x"), change(9, "y"), STOP)  # 656 (over), but 164 is under the floor
    feed(s, start(7), change(7, "g"), change(7, "h"), STOP)  # over, and 7 is past the floor: "h" spills
    spill = s._open[7].spill
    assert s._open[9].spill is None and s._open[8].spill is None and spill is not None and len(spill) == 1
    assert budget.streamed == 82 * 9  # what is in memory
    feed(s, stream_abort(8, 8))
    assert budget.streamed == 82 * 6
    feed(s, stream_commit(7, 1000, 1010))
    assert given_bytes(s)[1:-1] == [b"Ia", b"Ib", b"Ic", b"Ig", SPILLED, b"Ih"]
    assert (budget.streamed, budget.handed) == (82 * 2, 82 * 4)

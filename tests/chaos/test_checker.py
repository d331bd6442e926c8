"""The chaos checker itself: each kind of violation it must catch, on hand-made topic contents and
a hand-made audit history."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from datetime import UTC, datetime, timedelta
from typing import cast

import pytest
from confluent_kafka import Message

from harvester.postgres.schema.identifiers import TableName
from tests.chaos.audit import TERM, Change, confirmations, past_fence
from tests.chaos.harness import FAULT_KINDS, ChaosReport, ChaosSettings, Fault, analyse, first_copies
from tests.proc.processes import START_REFUSED, HarvesterProcess, harvester_spec
from tests.support.ports import free_ports

pytestmark = pytest.mark.unit


@dataclass
class FakeMessage:
    """The part of confluent_kafka.Message the checker reads."""

    value_text: str
    outbox_id: int | None
    offset_: int = 0

    def key(self) -> bytes:
        return self.value_text.split(":")[0].encode()

    def value(self) -> bytes:
        return self.value_text.encode()

    def headers(self) -> list[tuple[str, bytes]] | None:
        if self.outbox_id is None:
            return None
        return [("outbox-id", str(self.outbox_id).encode()), ("outbox-epoch", b"1"), ("outbox-producer", b"p")]

    def partition(self) -> int:
        return 0

    def offset(self) -> int:
        return self.offset_


def messages(*values: tuple[str, int | None]) -> list[FakeMessage]:
    return [FakeMessage(v, i, n) for n, (v, i) in enumerate(values)]


def as_messages(fakes: list[FakeMessage]) -> list[Message]:
    """The fakes where the checker wants messages: they implement the part of Message it reads."""
    return cast("list[Message]", fakes)


def report(
    delivery: str,
    msgs: list[FakeMessage],
    expected: dict[str, int],
    deduped: list[FakeMessage] | None = None,
    undelivered: frozenset[str] = frozenset(),
) -> ChaosReport:
    """A report over ``msgs``; the de-duplicating reader is assumed perfect unless ``deduped`` is given."""
    read = as_messages(msgs)
    kept = first_copies(read)[0] if deduped is None else as_messages(deduped)
    return ChaosReport(
        settings=ChaosSettings(seed=1, delivery=delivery),
        faults=[Fault(1.0, k, "x", "", 0.0) for k in FAULT_KINDS],
        skipped=Counter(),
        records_written=sum(expected.values()),
        writer_retries=0,
        writer_recovered=0,
        writer_errors=[],
        ledger_mismatch=[],
        left_in_outbox=len(undelivered),
        drain_seconds=1.0,
        leader_acquisitions=3,
        crashes=[],
        refused_starts=0,
        findings=analyse(read, kept, expected, undelivered),
        timeline=[],
    )


def test_clean_run_with_redeliveries_passes_at_least_once_only() -> None:
    msgs = messages(("a:0", 1), ("a:1", 2), ("a:0", 1), ("a:1", 2), ("b:0", 3))
    ok = report("at_least_once", msgs, {"a": 2, "b": 1})
    assert ok.violations() == []
    assert ok.findings.duplicates == 2 and ok.findings.dedup_dropped == 2 and ok.findings.dedup_left == 0
    assert "PASS" in ok.table()
    assert report("exactly_once", msgs, {"a": 2, "b": 1}).violations() != []


def test_loss_is_reported_per_record() -> None:
    r = report("at_least_once", messages(("a:0", 1), ("a:2", 3)), {"a": 3})
    assert r.findings.lost == ["a:1"]
    assert "FAIL" in r.table() and "1 records lost" in r.failure_text()


def test_records_still_in_the_outbox_are_not_lost_but_fail_as_not_drained() -> None:
    r = report("at_least_once", messages(("a:0", 1)), {"a": 3}, undelivered=frozenset({"a:1", "a:2"}))
    assert r.findings.lost == []
    assert r.violations() == ["outbox not drained within 180s: 2 records left"]


def test_reordered_first_deliveries_are_reported() -> None:
    r = report("at_least_once", messages(("a:1", 2), ("a:0", 1)), {"a": 2})
    assert list(r.findings.out_of_order) == ["a"] and r.violations()


def test_same_value_under_two_identities_survives_dedup_and_fails() -> None:
    # A writer that inserted a record twice would look like this: de-dup by identity cannot help.
    r = report("at_least_once", messages(("a:0", 1), ("a:0", 2)), {"a": 1})
    assert r.findings.left_by_identity == 1 and r.findings.dedup_left == 1 and r.violations()


def test_reader_that_misses_a_duplicate_or_drops_a_first_copy_fails() -> None:
    msgs = messages(("a:0", 1), ("a:1", 2), ("a:1", 2))
    missed = report("at_least_once", msgs, {"a": 2}, deduped=msgs)
    assert missed.findings.dedup_left == 1 and missed.violations()
    assert missed.findings.dedup_missed == {"a:1": ["0#1@p0/o0/e1", "1#2@p0/o1/e1", "1#2@p0/o2/e1"]}
    dropped = report("at_least_once", msgs, {"a": 2}, deduped=msgs[:1])
    assert dropped.findings.dedup_damage == ["a"] and dropped.violations()


def test_messages_without_identity_and_missing_fault_kinds_fail() -> None:
    r = report("at_least_once", messages(("a:0", None)), {"a": 1})
    assert r.findings.unidentified == 1 and r.violations()
    r = report("at_least_once", messages(("a:0", 1)), {"a": 1})
    r.faults = r.faults[1:]
    assert r.violations() == [f"fault kinds never injected: ['{FAULT_KINDS[0]}']"]


def test_a_start_the_database_refuses_is_told_from_a_crash() -> None:
    """A harvester process started while its database is down (a restart under a fault) exits
    with START_REFUSED, which the harnesses replace without counting a crash."""
    port = free_ports(1)  # nothing listens there
    dsn = f"host=127.0.0.1 port={port} user=harvester dbname=harvester connect_timeout=2"
    spec = harvester_spec(dsn, "127.0.0.1:1", TableName("public", "outbox"), "refused", "refused-h1")
    proc = HarvesterProcess(spec)
    assert proc.proc.wait(60) == START_REFUSED, "".join(proc.log)
    assert proc.refused_start()  # at once, as the harnesses ask: the reader may lag behind the exit
    proc.terminate()
    assert "cannot connect to PostgreSQL" in next(e["error"] for e in proc.events if e["event"] == "start_refused")


T0 = datetime(2026, 1, 1, tzinfo=UTC)


def at(seconds: float) -> datetime:
    return T0 + timedelta(seconds=seconds)


def test_a_change_by_a_holder_whose_term_was_superseded_is_past_the_fence() -> None:
    history = [
        Change(at(0), TERM, "a", 0, "epoch 1"),
        Change(at(1), "DELETE", "a", 0, "id 1"),  # a's own term
        Change(at(2), TERM, "b", 0, "epoch 2"),
        Change(at(3), "DELETE", "b", 0, "id 2"),  # b's term
        Change(at(4), "DELETE", "a", 0, "id 3"),  # a zombie's purge the fence let through
        Change(at(5), "dead letter", "a", 0, "id 4"),
        Change(at(6), "fence row", "a", 0, "epoch 2"),  # a stored position under b's epoch
    ]
    found = past_fence(history)
    assert len(found) == 3 and all("by 'a'" in v and "while 'b' held the term" in v for v in found)
    assert "DELETE id 3" in found[0] and "dead letter id 4" in found[1] and "fence row" in found[2]
    r = report("at_least_once", messages(("a:0", 1)), {"a": 1})
    r.past_fence = found
    assert "FAIL" in r.table() and r.violations() == [f"3 changes past a fence, the first: {found[0]}"]
    assert "past a fence: DELETE id 3" in r.failure_text()


def test_terms_are_per_shard_and_a_change_before_any_term_is_past_the_fence() -> None:
    history = [
        Change(at(0), "DELETE", "a", 1, "id 9"),  # no term of shard 1 yet
        Change(at(1), TERM, "a", 0),
        Change(at(1), TERM, "b", 1),
        Change(at(2), "DELETE", "a", 0, "id 1"),
        Change(at(3), "DELETE", "a", 1, "id 2"),  # a row of b's shard
        Change(at(4), TERM, "c", 1),
        Change(at(4), TERM, "a", 1),  # a takes shard 1 back: its changes there count again
        Change(at(5), "UPDATE", "a", 1, "id 3"),
    ]
    assert past_fence(history) == [
        "DELETE id 9 by 'a' on shard 1 at 00:00:00.000000 while 'nobody' held the term",
        "DELETE id 2 by 'a' on shard 1 at 00:00:03.000000 while 'b' held the term",
    ]


def test_a_slot_confirmation_past_the_fence_is_one_seen_between_two_samples_after_it() -> None:
    samples = [(at(0), 10, 7, "a"), (at(1), 20, 7, "a"), (at(3), 30, 7, "a"), (at(4), 40, 8, "b"), (at(5), 40, 8, "b")]
    moves = confirmations(samples)
    assert [(c.app, c.detail) for c in moves] == [("a", "confirmed 10->20"), ("a", "confirmed 20->30")]
    # b's term began between the second and the third sample: a may have confirmed before it.
    assert past_fence([Change(at(0), TERM, "a", 0), Change(at(2), TERM, "b", 0), *moves]) == []
    # Begun before both samples of the second move: a's move came after it.
    late = past_fence([Change(at(0), TERM, "a", 0), Change(at(0.5), TERM, "b", 0), *moves])
    assert late == [
        "slot confirmed 20->30 by 'a' on shard 0 at 00:00:01.000000..00:00:03.000000 while 'b' held the term"
    ]

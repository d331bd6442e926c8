"""The chaos checker itself: each kind of violation it must catch, on hand-made topic contents."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass
from typing import cast

import pytest
from confluent_kafka import Message

from harvester.postgres.identifiers import TableName
from tests.chaos.harness import FAULT_KINDS, ChaosReport, ChaosSettings, Fault, analyse, first_copies
from tests.proc.processes import START_REFUSED, HarvesterProcess, harvester_spec
from tests.support import free_ports

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
    assert r.violations() == ["outbox not drained within 180s: 2 left"]


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

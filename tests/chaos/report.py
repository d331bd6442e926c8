"""A run's report: its violations, its summary table and what a failure needs to be investigated."""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

from tests.chaos.checking import Findings, broken_guarantees
from tests.chaos.faults import Fault
from tests.chaos.services import positioned
from tests.chaos.settings import ChaosSettings


@dataclass
class ChaosReport:
    """Everything a chaos run measured, its violations and a printable summary."""

    settings: ChaosSettings
    faults: list[Fault]
    skipped: Counter[str]
    records_written: int
    writer_retries: int
    writer_recovered: int
    writer_errors: list[str]
    ledger_mismatch: list[str]
    left_in_outbox: int
    drain_seconds: float
    leader_acquisitions: int
    crashes: list[str]
    refused_starts: int
    findings: Findings
    timeline: list[str]
    log_tails: dict[str, list[str]] = field(default_factory=dict)  # when the outbox did not drain
    logs: Path | None = None  # where a failed run's harvester logs were saved
    purges_of_lost: dict[str, list[str]] = field(default_factory=dict)
    past_fence: list[str] = field(default_factory=list)  # changes the fence let through (tests.chaos.audit)

    def violations(self) -> list[str]:
        """Every broken guarantee (and every harness failure that makes the run meaningless)."""
        out = broken_guarantees(self.findings, self.settings.delivery)
        if self.past_fence:
            out.append(f"{len(self.past_fence)} changes past a fence, the first: {self.past_fence[0]}")
        if self.left_in_outbox:
            what = "bytes of log not stored done" if positioned(self.settings) else "records"
            out.append(
                f"outbox not drained within {self.settings.drain_timeout:.0f}s: {self.left_in_outbox} {what} left"
            )
        missing = [k for k in self.settings.faults if not any(x.kind == k for x in self.faults)]
        if missing:
            out.append(f"fault kinds never injected: {missing}")
        out += [f"harvester crashed: {c}" for c in self.crashes]
        out += [f"writer failed: {e}" for e in self.writer_errors]
        out += [f"ledger and writers disagree: {m}" for m in self.ledger_mismatch]
        return out

    def table(self) -> str:
        """The summary table: faults by kind, records, duplicates, drain time, verdict."""
        s, f = self.settings, self.findings
        by_kind = Counter(x.kind for x in self.faults)
        lines = [
            f"chaos run: seed {s.seed}, source {s.source}{s.variant}, delivery {s.delivery}, "
            f"{s.fault_seconds:.0f}s of faults, "
            f"{s.harvesters} harvesters{f' over {s.shards} shards' if s.shards > 1 else ''}, {s.writers} writers, "
            f"{s.keys}+{s.hot_keys} keys, "
            f"~{s.records_per_second:.0f} records/s",
            "",
            f"{'fault':<24}{'injected':>10}{'skipped':>10}",
        ]
        lines += [f"{k:<24}{by_kind[k]:>10}{self.skipped[k]:>10}" for k in s.faults]
        rows: list[tuple[str, object]] = [
            ("faults total", len(self.faults)),
            ("leader acquisitions", self.leader_acquisitions),
            ("records written", self.records_written),
            ("writer retries (recovered)", f"{self.writer_retries} ({self.writer_recovered})"),
            ("records read (read_committed)", f.records_read),
            ("records lost", len(f.lost)),
            ("records left in outbox", self.left_in_outbox),
            ("changes past a fence", len(self.past_fence)),
            ("keys out of order", len(f.out_of_order)),
            ("duplicates (read_committed)", f.duplicates),
            ("dropped by DedupReader", f.dedup_dropped),
            ("duplicates after DedupReader", f.dedup_left),
            ("drain time", f"{self.drain_seconds:.1f}s"),
            ("harvester crashes", len(self.crashes)),
            ("starts refused (replaced)", self.refused_starts),
            ("verdict", "FAIL" if self.violations() else "PASS"),
        ]
        lines += ["", *(f"{name:<32}{value!s:>12}" for name, value in rows)]
        return "\n".join(lines)

    def failure_text(self) -> str:
        """Violations plus what is needed to reproduce and investigate them."""
        s, f = self.settings, self.findings
        parts = [
            f"seed {s.seed} (replay: CHAOS_SEED={s.seed}), delivery {s.delivery}",
            *(f"VIOLATION: {v}" for v in self.violations()),
            f"harvester logs: {self.logs}",
            "faults:",
            *(f"  {x}" for x in self.faults),
            "harvester events:",
            *(f"  {x}" for x in self.timeline),
            *(f"past a fence: {x}" for x in self.past_fence[:20]),
        ]
        for value in f.lost[:20]:
            parts.append(f"lost {value}: {'; '.join(self.purges_of_lost.get(value, [])) or 'no purge recorded'}")
        for key, firsts in list(f.out_of_order.items())[:10]:
            parts.append(f"order {key}: first deliveries (seq#id@partition/offset/epoch) {' '.join(firsts[:40])}")
        for name, tail in self.log_tails.items():
            parts += [f"last log lines of {name}:", *(f"  {line}" for line in tail)]
        for value, history in f.dedup_missed.items():
            parts.append(f"DedupReader passed {value} twice; deliveries of its key around them: {' '.join(history)}")
        return "\n".join(parts)

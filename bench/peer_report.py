"""bench/peers.py's output: the burst's medians with each relay's ratios to Debezium, its shares of
the ceilings and its memory; the steady phase's latencies; the JSON document of a run (its fields
are described in bench/peers.py's docstring)."""

from __future__ import annotations

import statistics
from dataclasses import asdict
from typing import Any

from ceilings import Ceiling
from peer_bursts import Burst
from steady import Steady


def report(results: dict[str, list[Burst]], records: int) -> None:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    first = next(iter(results.values()))
    debezium, debezium_pg = med([b.rate for b in first]), med([b.cpu_postgres for b in first])
    print(
        f"{'burst of ' + str(records):<44} {'records/s':>10} {'vs Debezium':>12} {'per round':>20}"
        f" {'CPU s/1000: relay':>18} {'PostgreSQL':>11} {'walsender':>10} {'vs Debezium':>12} {'broker':>7}  notes"
    )
    for name, bursts in results.items():
        rate, pg = med([b.rate for b in bursts]), med([b.cpu_postgres for b in bursts])
        paired = [b.rate / d.rate for b, d in zip(bursts, first, strict=True)]
        per_round = f"{med(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})"
        notes = []
        empties = [b.rate_empty for b in bursts if b.rate_empty is not None]
        if empties:
            done = "slot confirmed" if "table-less" in name or "retention" in name else "empty outbox"
            notes.append(f"to all records on the topic; to {done} {med(empties):.0f} records/s")
        else:
            notes.append("to all records on the topic")
        swept = [b.cpu_postgres_swept for b in bursts if b.cpu_postgres_swept is not None]
        if swept:  # the delivery's figure leaves the bulk delete out: this one has it
            swept_rate = med([b.rate_swept for b in bursts if b.rate_swept is not None])
            notes.append(
                f"PostgreSQL with the bulk delete (to empty outbox, {swept_rate:.0f} records/s):"
                f" {med(swept):.3f}, {med(swept) / debezium_pg:.1f}x Debezium"
            )
        extra = max(b.extra for b in bursts)
        if extra:
            notes.append(f"{extra} duplicates on the topic")
        collected = [b for b in bursts if b.gc_seconds is not None]
        if collected:
            gc_cpu = med([b.gc_seconds or 0.0 for b in collected])
            runs = med([float(b.gc_collections) for b in collected])
            notes.append(f"relay CPU in garbage collections {gc_cpu:.4f} ({runs:.0f} runs)")
        vacuums = sum(b.autovacuums for b in bursts)
        if vacuums:
            notes.append(f"{vacuums} autovacuum/autoanalyze runs within the measurement")
        print(
            f"{name:<44} {rate:10.0f} {rate / debezium:11.2f}x {per_round:>20}"
            f" {med([b.cpu_relay for b in bursts]):18.3f} {pg:11.3f} {med([b.cpu_walsender for b in bursts]):10.3f}"
            f" {pg / debezium_pg:11.1f}x {med([b.cpu_broker for b in bursts]):7.3f}  {'; '.join(notes)}"
        )


def report_steady(name: str, result: Steady) -> None:
    missing = f"; {result.missing} not received within 60 s" if result.missing else ""
    print(
        f"  {name:<42} inserted {result.inserted:6.0f}/s  p50 {result.p50_ms:6.1f} ms  p99 {result.p99_ms:7.1f} ms"
        f"  CPU relay {result.cpu_relay:.3f}, PostgreSQL {result.cpu_postgres:.3f}{missing}",
        flush=True,
    )


def _med(values: list[float]) -> float:
    return statistics.median(values)


def shares(bursts: list[Burst], ceiling: list[Ceiling]) -> dict[str, float] | None:
    """A relay's rate over a ceiling's, round by round (both ran in the same round): the median and
    range of those ratios (None without that ceiling)."""
    if not ceiling:
        return None
    paired = [b.rate / c.rate for b, c in zip(bursts, ceiling, strict=True)]
    return {"median": _med(paired), "min": min(paired), "max": max(paired)}


def summary(results: dict[str, list[Burst]], ceilings: dict[str, list[Ceiling]]) -> dict[str, dict[str, Any]]:
    """Per relay: the medians of its rounds, its ratios to Debezium's rate and CPU, its shares of
    the ceilings, its memory."""
    first = next(iter(results.values()))
    out: dict[str, dict[str, Any]] = {}
    for name, bursts in results.items():
        paired = [b.rate / d.rate for b, d in zip(bursts, first, strict=True)]
        heaps = [b.jvm_heap for b in bursts if b.jvm_heap is not None]
        out[name] = {
            "rate": _med([b.rate for b in bursts]),
            "vs_debezium": {"median": _med(paired), "min": min(paired), "max": max(paired)},
            "cpu_relay": _med([b.cpu_relay for b in bursts]),
            "cpu_postgres": _med([b.cpu_postgres for b in bursts]),
            "cpu_walsender": _med([b.cpu_walsender for b in bursts]),
            "cpu_broker": _med([b.cpu_broker for b in bursts]),
            "cpu_relay_vs_debezium": _med([b.cpu_relay for b in bursts]) / _med([d.cpu_relay for d in first]),
            "cpu_postgres_vs_debezium": _med([b.cpu_postgres for b in bursts]) / _med([d.cpu_postgres for d in first]),
            "shares": {kind: shares(bursts, rounds) for kind, rounds in ceilings.items() if rounds},
            "rss_start_mib": _med([b.rss_start for b in bursts]),
            "rss_peak_mib": max(b.rss_peak for b in bursts),
            "rss_exact": all(b.rss_exact for b in bursts),
            "jvm_heap_peak_used_mib": max((h.peak_used for h in heaps), default=None),
            "jvm_heap_committed_mib": max((h.committed for h in heaps), default=None),
        }
    return out


def report_ceilings(ceilings: dict[str, list[Ceiling]], records: int) -> None:
    if not any(ceilings.values()):
        return
    print(
        f"{'ceilings, burst of ' + str(records):<44} {'records/s':>10} {'per round':>22}"
        f" {'CPU s/1000: client':>19} {'PostgreSQL':>11} {'walsender':>10} {'broker':>7}"
    )
    labels = {
        "decode": "decode: pg_recvlogical, log source's options",
        "produce": "produce-only: the harvester's producer",
        "delete": "single write: DELETE ... RETURNING 500",
    }
    for kind, rounds in ceilings.items():
        if not rounds:
            continue
        rates = [c.rate for c in rounds]
        cpu = [
            "      -" if any(getattr(c, f) is None for c in rounds) else f"{_med([getattr(c, f) for c in rounds]):.3f}"
            for f in ("cpu_client", "cpu_postgres", "cpu_walsender", "cpu_broker")
        ]
        print(
            f"{labels[kind]:<44.44} {_med(rates):10.0f} {' '.join(f'{r:.0f}' for r in rates):>22}"
            f" {cpu[0]:>19} {cpu[1]:>11} {cpu[2]:>10} {cpu[3]:>7}"
        )


def report_shares(results: dict[str, list[Burst]], ceilings: dict[str, list[Ceiling]]) -> None:
    """Each relay's share of the ceilings (median of the rounds' ratios, with their range) and its memory."""
    table = summary(results, ceilings)
    kinds = [k for k, rounds in ceilings.items() if rounds]
    print(
        f"{'shares of the ceilings, memory':<44}"
        + "".join(f" {'of ' + k:>20}" for k in kinds)
        + f" {'RSS MiB: start':>15} {'peak':>6}  JVM heap MiB: peak used / committed"
    )
    for name, row in table.items():
        cells = []
        for k in kinds:
            sh = row["shares"][k]
            cells.append(f" {sh['median']:.2f} ({sh['min']:.2f}-{sh['max']:.2f})".rjust(21))
        heap = ""
        if row["jvm_heap_committed_mib"] is not None:
            heap = f"  {row['jvm_heap_peak_used_mib']:.0f} / {row['jvm_heap_committed_mib']:.0f}"
        exact = "" if row["rss_exact"] else " (peak since start)"
        print(f"{name:<44}" + "".join(cells) + f" {row['rss_start_mib']:15.0f} {row['rss_peak_mib']:6.0f}{heap}{exact}")


def document(
    meta: dict[str, Any],
    relays: dict[str, dict[str, Any]],
    results: dict[str, list[Burst]],
    ceilings: dict[str, list[Ceiling]],
    steadies: dict[str, Steady],
) -> dict[str, Any]:
    """The run as JSON (bench/peers.py's docstring lists the fields)."""
    return {
        **meta,
        "ceilings": {k: [asdict(c) for c in rounds] for k, rounds in ceilings.items() if rounds},
        "relays": {name: {**relays[name], "rounds": [asdict(b) for b in bursts]} for name, bursts in results.items()},
        "summary": summary(results, ceilings),
        "steady": {name: asdict(s) for name, s in steadies.items()},
    }

"""Chaos harness: harvester processes, continuous writers and a fault injector on a private
PostgreSQL and a private Kafka broker, then a loss/order/duplicate check of every output topic.

:func:`run_chaos` is shared by ``tests/chaos/test_chaos.py`` (a short run) and ``bench/soak.py``
(a long one). One seed drives the fault sequence, the gaps between faults, the stop durations and
the writers' key choices, so a failing run's fault sequence can be replayed; the timing relative to
the harvesters' own threads cannot be replayed exactly.

The private services (their own ports and data directories under ``.local/private-chaos``) are
restarted by the injector, so the shared PostgreSQL and Kafka other tests use are never disturbed.

The parts, one module each: ``settings``, ``services`` (the private services and the run's tables),
``writers``, ``harvesters``, ``faults``, ``audit`` (no change past a fence), ``checking`` (the
topics against the ledger) and ``report``.
"""

from __future__ import annotations

import time

import structlog.testing

from tests.chaos import audit
from tests.chaos.checking import Findings, analyse, broken_guarantees, first_copies, read_all
from tests.chaos.faults import Fault, FaultInjector
from tests.chaos.harvesters import HarvesterGroup
from tests.chaos.report import ChaosReport
from tests.chaos.services import Tables, log_setup, private_services, wal_end
from tests.chaos.settings import FAULT_KINDS, ChaosSettings, Log, delivery_modes
from tests.chaos.writers import Writers
from tests.support.kafka import create_topics, delete_topics
from tests.support.names import unique
from tests.support.paths import ROOT
from tests.support.postgres import streamed_transactions, streaming
from tests.support.private_services import PrivateKafka, PrivatePostgres

# What the fault tests and the soak benches import from here.
__all__ = [
    "FAULT_KINDS",
    "ChaosReport",
    "ChaosSettings",
    "Fault",
    "Findings",
    "HarvesterGroup",
    "Tables",
    "Writers",
    "analyse",
    "broken_guarantees",
    "delivery_modes",
    "first_copies",
    "read_all",
    "run_chaos",
]


def run_chaos(
    settings: ChaosSettings, log: Log = print, services: tuple[PrivatePostgres, PrivateKafka] | None = None
) -> ChaosReport:
    """Run one chaos scenario end to end and report; raises only when the harness itself cannot
    proceed (services that do not start, no first leader, a topic that cannot be read back).
    ``services``: the private services of earlier runs, to run on instead of starting and stopping
    a pair of the run's own (:func:`private_services`)."""
    if services is None:
        with private_services(settings) as own:
            return run_chaos(settings, log, own)
    pg, kafka = services
    # Idempotent: started again if a fault of an earlier run left one down.
    pg.start()
    kafka.start()
    tables = Tables.create(pg.dsn, settings)
    topics = [unique("chaos") for _ in range(settings.topics)]
    create_topics(kafka.bootstrap, topics, settings.partitions)
    dsn = streaming(pg.dsn) if settings.large_every else pg.dsn
    group = HarvesterGroup(settings, dsn, tables.outbox, kafka.bootstrap)
    writers = Writers(settings, pg.dsn, tables, topics)
    slot = audit.SlotWatch(pg.dsn, log_setup(tables.outbox, settings).slot) if settings.source == "log" else None
    try:
        if slot is not None:
            slot.start()
        group.start()
        if group.wait_leader(60.0) is None:
            raise RuntimeError("no harvester became leader within 60 s")
        started, started_wall = time.monotonic(), time.time()
        writers.start()
        log(f"chaos: seed {settings.seed}, outbox {tables.outbox}, topics {topics}")
        injector = FaultInjector(settings, group, pg, kafka, log)
        injector.run(started)
        writers.stop()
        stopped = time.monotonic()
        log(f"chaos: writers stopped after {stopped - started:.1f}s, {writers.records} records; draining")
        left = tables.drain(pg.dsn, settings.drain_timeout, wal_end(pg.dsn))
        drain_seconds = time.monotonic() - stopped
        if settings.large_every:
            streamed = streamed_transactions(pg.dsn)
            log(f"chaos: transactions streamed in progress since the server's last restart: {streamed}")
        group.replace_crashed()
        expected = tables.expected(pg.dsn)
        tails = group.log_tails(5) if left else {}
        raw = read_all(kafka.bootstrap, topics, settings.partitions, 120.0)
        with structlog.testing.capture_logs():  # the reader logs every drop at debug level
            deduped = read_all(kafka.bootstrap, topics, settings.partitions, 120.0, dedup=True)
        findings = analyse(raw, deduped, expected, tables.undelivered(pg.dsn))
    finally:
        writers.stop()
        group.stop()
        if slot is not None:
            slot.stop()
    history = audit.history(pg.dsn, tables.audit) + ([] if slot is None else slot.confirmations())
    report = ChaosReport(
        settings=settings,
        faults=injector.faults,
        skipped=injector.skipped,
        records_written=writers.records,
        writer_retries=writers.retries,
        writer_recovered=writers.recovered,
        writer_errors=writers.errors,
        ledger_mismatch=_compare(expected, writers.next_seq),
        left_in_outbox=left,
        drain_seconds=drain_seconds,
        leader_acquisitions=group.acquisitions(),
        crashes=group.crashes,
        refused_starts=group.refused_starts,
        findings=findings,
        timeline=group.timeline(started_wall),
        log_tails=tails,
        past_fence=audit.past_fence(history),
    )
    if findings.lost:
        report.purges_of_lost = audit.changes_of(pg.dsn, tables.audit, findings.lost[:20])
    if report.violations():
        # A failed run's schema and topics stay in the private cluster as evidence, with the logs.
        report.logs = ROOT / ".local" / "private-chaos" / "runs" / tables.schema
        group.save_logs(report.logs)
    else:
        tables.drop(pg.dsn)
        delete_topics(kafka.bootstrap, topics)
    return report


def _compare(ledger: dict[str, int], written: dict[str, int]) -> list[str]:
    """Keys whose committed count differs between the ledger and the writers' own bookkeeping."""
    keys = sorted(set(ledger) | set(written))
    return [
        f"{k}: ledger {ledger.get(k, 0)}, writers {written.get(k, 0)}" for k in keys if ledger.get(k) != written.get(k)
    ]

"""Chaos test (issue 8): three harvester processes, continuous writers and random faults (leader
SIGKILL and SIGSTOP, Kafka and PostgreSQL restarts, terminated connections); afterwards no record
may be lost or reordered, and no duplicate may survive de-duplication.

The seed is printed (and part of every failure message); replay with ``CHAOS_SEED=<seed>``.
``CHAOS_SECONDS`` changes the length of the fault window (default 30 s, faults 1-4 s apart: every
fault kind is drawn once first, however long that takes, and ten runs keep the suite's time in
bounds); ``CHAOS_PG_PORT`` and
``CHAOS_KAFKA_PORT`` the private services' ports (15432 and 29092). It runs unsharded and with
``shards: 4`` (the three processes then share the shards, and faults hit any process that leads
one). ``bench/soak.py`` runs the same scenario for longer.
"""

from __future__ import annotations

import dataclasses
import os
import random
from collections.abc import Iterator
from typing import Any

import pytest

from tests.chaos.harness import FAULT_KINDS, ChaosSettings, delivery_modes, run_chaos
from tests.chaos.services import private_services
from tests.support.private_services import PrivateKafka, PrivatePostgres

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# One run per delivery mode the config offers (HarvesterConfig.delivery), the checks differ by mode,
# unsharded; with 4 shards once, in exactly-once mode, whose fencing of a shard's transactions is the
# stricter (tests/shards covers at-least-once shards handed over); mark-purge/reset with one record
# of a key in flight (keyRelease: purged) once; the log source (unsharded: it
# reads one slot); and its two variants that store how far they are done instead of deleting rows as
# they go, a retention window and a table-less outbox, each with a smaller schedule (no broker
# restart: it takes 20 s to minutes on a loaded machine, and those runs exercise the same producer as
# the others).
# Every run draws each of its fault kinds at least once (FaultInjector.run) 1-4 s apart, so a fault
# often lands while the harvesters still recover from the one before; the window past that is
# short: what a run proves is that no kind loses, reorders or duplicates anything, and every record
# written in the window costs drain and read-back time.
SCHEDULE: dict[str, Any] = {
    "min_gap": 1.0,
    "max_gap": 4.0,
    "fault_seconds": float(os.environ.get("CHAOS_SECONDS", "30")),
}
SMALL: dict[str, Any] = {
    "faults": tuple(k for k in FAULT_KINDS if k != "restart_kafka"),
    "fault_seconds": float(os.environ.get("CHAOS_SECONDS", "20")),
}
VARIANTS: dict[str, dict[str, Any]] = {
    "mark_purge": {},
    # goharvest's barrier: a key's next record only after its previous one's purge (keyRelease:
    # purged; the default sends it at the acknowledgement, as the log source does).
    "one-per-key": {"key_release": "purged", **SMALL},
    "log": {"source": "log", "large_every": 10.0},  # the log source gets transactions it streams too
    "retention": {"source": "log", "log_retention": 2.0, **SMALL},
    "table-less": {"source": "log", "log_messages": True, **SMALL},
    # Debezium's outbox layout, its rows deleted as they are inserted (docs/migrating.md): one run,
    # at least once (tests/debezium/test_layout.py covers exactly once without faults).
    "debezium": {"source": "log", "layout": "debezium", **SMALL},
}


PORTS = ChaosSettings(
    seed=0,
    pg_port=int(os.environ.get("CHAOS_PG_PORT", "15432")),
    kafka_port=int(os.environ.get("CHAOS_KAFKA_PORT", "29092")),
)


@pytest.fixture(scope="module")
def chaos_services() -> Iterator[tuple[PrivatePostgres, PrivateKafka]]:
    """One private PostgreSQL and Kafka for all the runs (each has its own schema and topics): a
    broker's start alone takes 10-20 s."""
    with private_services(PORTS) as started:
        yield started


@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("delivery", "shards", "variant"),
    [
        (mode, shards, variant)
        for mode in delivery_modes()
        for shards, variant in ((1, "mark_purge"), (1, "log"), (1, "retention"), (1, "table-less"))
    ]
    + [("exactly_once", 4, "mark_purge"), ("at_least_once", 1, "one-per-key"), ("at_least_once", 1, "debezium")],
)
def test_chaos(chaos_services: tuple[PrivatePostgres, PrivateKafka], delivery: str, shards: int, variant: str) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"chaos seed {seed} (replay: CHAOS_SEED={seed})", flush=True)
    settings = ChaosSettings(
        seed=seed,
        delivery=delivery,
        shards=shards,
        pg_port=PORTS.pg_port,
        kafka_port=PORTS.kafka_port,
    )
    settings = dataclasses.replace(settings, **{**SCHEDULE, **VARIANTS[variant]})
    report = run_chaos(settings, log=lambda line: print(line, flush=True), services=chaos_services)
    print(report.table())
    assert report.violations() == [], report.failure_text()

"""Chaos test (issue 8): three harvester processes, continuous writers and random faults (leader
SIGKILL and SIGSTOP, Kafka and PostgreSQL restarts, terminated connections); afterwards no record
may be lost or reordered, and no duplicate may survive de-duplication.

The seed is printed (and part of every failure message); replay with ``CHAOS_SEED=<seed>``.
``CHAOS_SECONDS`` changes the length of the fault window (default 60 s: every fault kind is drawn
once first, and six runs keep the suite's time in bounds); ``CHAOS_PG_PORT`` and
``CHAOS_KAFKA_PORT`` the private services' ports (15432 and 29092). It runs unsharded and with
``shards: 4`` (the three processes then share the shards, and faults hit any process that leads
one). ``bench/soak.py`` runs the same scenario for longer.
"""

from __future__ import annotations

import os
import random

import pytest

from tests.chaos.harness import ChaosSettings, delivery_modes, run_chaos

pytestmark = [pytest.mark.integration, pytest.mark.slow]


# One run per delivery mode the config offers (HarvesterConfig.delivery), the checks differ by mode,
# unsharded and with 4 shards; and the log source (unsharded: it reads one slot).
@pytest.mark.timeout(900)
@pytest.mark.parametrize(
    ("delivery", "shards", "source"),
    [
        (mode, shards, source)
        for mode in delivery_modes()
        for shards, source in ((1, "mark_purge"), (4, "mark_purge"), (1, "log"))
    ],
)
def test_chaos(delivery: str, shards: int, source: str) -> None:
    seed = int(os.environ.get("CHAOS_SEED") or random.SystemRandom().randrange(1 << 31))
    print(f"chaos seed {seed} (replay: CHAOS_SEED={seed})", flush=True)
    settings = ChaosSettings(
        seed=seed,
        delivery=delivery,
        shards=shards,
        source=source,
        large_every=10.0 if source == "log" else 0.0,  # the log source gets transactions it streams too
        fault_seconds=float(os.environ.get("CHAOS_SECONDS", "60")),
        pg_port=int(os.environ.get("CHAOS_PG_PORT", "15432")),
        kafka_port=int(os.environ.get("CHAOS_KAFKA_PORT", "29092")),
    )
    report = run_chaos(settings, log=lambda line: print(line, flush=True))
    print(report.table())
    assert report.violations() == [], report.failure_text()

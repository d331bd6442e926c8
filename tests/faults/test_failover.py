"""PostgreSQL failover (issue 22): the primary crashes mid-run and its synchronous standby is
promoted; harvesters and writers follow through a multi-host DSN (target_session_attrs=read-write).
Nothing is lost, per-key order holds, and the fence carries on (its table is replicated)."""

from __future__ import annotations

import time

import pytest

from tests.chaos.harness import delivery_modes
from tests.faults.pgpair import PgPair
from tests.faults.scenario import Scenario, settings
from tests.support import Services

pytestmark = [pytest.mark.integration]


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delivery", delivery_modes())
def test_primary_crash_and_promotion(services: Services, pg_pair: PgPair, delivery: str) -> None:
    with Scenario(settings(delivery), pg_pair.dsn, services.bootstrap) as sc:
        sc.spawn_leader("failover-a")
        sc.spawn("failover-b")
        sc.writers.start()
        sc.wait_published(150)
        epoch = pg_pair.epoch(sc.tables.outbox)
        pg_pair.crash()
        crashed = time.time()
        pg_pair.promote()
        sc.wait_published(150)
        print(f"failover: first purge {sc.first_purge_after(crashed):.1f}s after the crash")
        assert pg_pair.epoch(sc.tables.outbox) >= epoch > 0  # the fence survived the promotion
        outcome = sc.finish()
        assert outcome.violations() == [], outcome.explain()

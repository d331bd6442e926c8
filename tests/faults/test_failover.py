"""PostgreSQL failover (issue 22): the primary crashes mid-run and its synchronous standby is
promoted; harvesters and writers follow through a multi-host DSN (target_session_attrs=read-write).
Nothing is lost, per-key order holds, and the fence carries on (its table is replicated). With the
log source (issue 41) the slot carries on too: a failover slot the standby synchronizes."""

from __future__ import annotations

import time

import pytest

from harvester import HarvesterConfig
from tests.chaos.harness import delivery_modes
from tests.faults.pgpair import PgPair
from tests.faults.scenario import Scenario, settings
from tests.support.services import Services

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


@pytest.mark.timeout(300)
@pytest.mark.parametrize("delivery", delivery_modes())
def test_promotion_in_log_mode(services: Services, pg_pair: PgPair, delivery: str) -> None:
    """The log source's failover slot (PostgreSQL 17+): the standby keeps a synchronized copy, the
    leader reconnects to the promoted standby through the DSN's host list and goes on from the copy."""
    with Scenario(settings(delivery, source="log"), pg_pair.dsn, services.bootstrap) as sc:
        slot = HarvesterConfig(outbox_table=sc.tables.outbox.qualified).slot
        sc.spawn_leader("promotion-a")
        sc.spawn("promotion-b")
        sc.writers.start()
        sc.wait_published(150)
        pg_pair.wait_synchronized(slot)
        pg_pair.crash()
        crashed = time.time()
        pg_pair.promote()
        sc.wait_published(150)
        print(f"promotion in log mode: first purge {sc.first_purge_after(crashed):.1f}s after the crash")
        assert pg_pair.failover_slot(slot)  # the copy, on the new primary
        outcome = sc.finish()
        assert outcome.violations() == [], outcome.explain()

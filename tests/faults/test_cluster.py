"""Broker faults on a 3-node cluster (issue 22): replication 3, min.insync.replicas 2, acks=all.
A broker that matters is SIGKILLed mid-run and restarted; nothing may be lost or reordered, and in
exactly-once mode a read_committed consumer sees no duplicate."""

from __future__ import annotations

import time
from collections.abc import Callable

import pytest

from tests.faults.cluster import KafkaCluster
from tests.faults.scenario import Scenario, settings
from tests.support.services import Services

pytestmark = [pytest.mark.integration]


def _kill_mid_run(services: Services, cluster: KafkaCluster, delivery: str, victim: Callable[[Scenario], int]) -> None:
    """Two harvesters on the cluster; once records flow, SIGKILL the broker ``victim`` names,
    wait for progress without it, restart it, and check everything written."""
    with Scenario(settings(delivery), services.pg_dsn, cluster.bootstrap) as sc:
        sc.spawn_leader("cluster-a")
        sc.spawn("cluster-b")
        sc.writers.start()
        sc.wait_published(150)
        node = victim(sc)
        killed = time.time()
        cluster.kill(node)
        sc.wait_published(150)  # progress on the two brokers left
        print(f"broker {node} killed; progress after {time.time() - killed:.1f}s")
        cluster.start_node(node)
        sc.wait_published(100)
        print(f"broker {node} back; progress after {time.time() - killed:.1f}s")
        outcome = sc.finish()
        print(f"checked {time.time() - killed:.1f}s")
        assert outcome.violations() == [], outcome.explain()


@pytest.mark.timeout(400)
def test_outbox_partition_leader_killed(services: Services, whole_cluster: KafkaCluster) -> None:
    def leader_of_partition_0(sc: Scenario) -> int:
        return whole_cluster.leader_of(sc.topics[0], 0)

    _kill_mid_run(services, whole_cluster, "at_least_once", leader_of_partition_0)


@pytest.mark.timeout(400)
def test_transaction_coordinator_killed(services: Services, whole_cluster: KafkaCluster) -> None:
    def transaction_coordinator(sc: Scenario) -> int:
        return whole_cluster.transaction_coordinator(f"{sc.leader_group}.harvester")

    _kill_mid_run(services, whole_cluster, "exactly_once", transaction_coordinator)


@pytest.mark.timeout(400)
def test_leader_group_coordinator_killed(services: Services, whole_cluster: KafkaCluster) -> None:
    """NELI's group loses its coordinator; the election carries on on another broker."""

    def group_coordinator(sc: Scenario) -> int:
        return whole_cluster.group_coordinator(sc.leader_group)

    _kill_mid_run(services, whole_cluster, "at_least_once", group_coordinator)

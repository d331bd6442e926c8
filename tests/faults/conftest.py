"""Fixtures of the fault tests: the private Kafka cluster, started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.cluster import KafkaCluster

# The cluster's ports: CLUSTER_PORT to +39 (see deploy/local/cluster.sh), used by no other test.
CLUSTER_PORT = 35000


@pytest.fixture(scope="session")
def cluster() -> Iterator[KafkaCluster]:
    """Three brokers, replication 3, min.insync.replicas 2; stopped at the end of the session."""
    c = KafkaCluster("faults", CLUSTER_PORT)
    c.start()
    yield c
    c.stop()


@pytest.fixture
def whole_cluster(cluster: KafkaCluster) -> KafkaCluster:
    """The cluster with every broker up and in sync (a test before may have killed one)."""
    cluster.start()
    return cluster

"""Fixtures of the fault tests: the private Kafka cluster, started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.cluster import KafkaCluster
from tests.faults.pgpair import PgPair
from tests.support.ports import free_ports

# Ports from tests.support.ports.free_ports, outside the kernel's ephemeral range: the cluster takes 60
# from its first, with two proxied listener sets (see deploy/local/cluster.sh), the PostgreSQL pair 2.
CLUSTER_PORTS = 60
PGPAIR_PORTS = 2


@pytest.fixture(scope="session")
def cluster() -> Iterator[KafkaCluster]:
    """Three brokers, replication 3, min.insync.replicas 2, two proxied listener sets; stopped at the
    end of the session."""
    c = KafkaCluster("faults", free_ports(CLUSTER_PORTS), proxied=2)  # a path of its own for each of two processes
    c.start()
    yield c
    c.stop()


@pytest.fixture
def whole_cluster(cluster: KafkaCluster) -> KafkaCluster:
    """The cluster with every broker up and in sync (a test before may have killed one)."""
    cluster.start()
    return cluster


@pytest.fixture(scope="session")
def pg_pair() -> Iterator[PgPair]:
    """A primary and its synchronous standby; stopped at the end of the session."""
    pair = PgPair("faults", free_ports(PGPAIR_PORTS))
    pair.start()
    yield pair
    pair.stop()

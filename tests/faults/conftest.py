"""Fixtures of the fault tests: the private Kafka cluster, started once per session."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from tests.faults.cluster import KafkaCluster
from tests.faults.pgpair import PgPair

# Ports used by no other test: the cluster's CLUSTER_PORT to +39 (see deploy/local/cluster.sh),
# the PostgreSQL pair's PGPAIR_PORT and +1.
CLUSTER_PORT = 35000
PGPAIR_PORT = 35100


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


@pytest.fixture(scope="session")
def pg_pair() -> Iterator[PgPair]:
    """A primary and its synchronous standby; stopped at the end of the session."""
    pair = PgPair("faults", PGPAIR_PORT)
    pair.start()
    yield pair
    pair.stop()

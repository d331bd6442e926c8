"""A 3-node KRaft Kafka cluster of the fault tests' own (``deploy/local/cluster.sh``), and where
its partition leaders and coordinators are, so that a test can kill the broker that matters."""

from __future__ import annotations

import os
import subprocess
import time
from collections.abc import Iterator
from contextlib import ExitStack, contextmanager

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

from tests.faults.proxy import Mode, Proxy
from tests.support.paths import ROOT
from tests.support.private_services import QUICK_JVM

SCRIPT = ROOT / "deploy" / "local" / "cluster.sh"


def java_hash(text: str) -> int:
    """Java's ``String.hashCode`` passed through Kafka's ``Utils.abs``: which partition of an
    internal topic (``__consumer_offsets``, ``__transaction_state``) holds a group or a
    transactional id, hence which broker coordinates it."""
    h = 0
    for unit in text.encode("utf-16-be").hex(" ", 2).split():
        h = (31 * h + int(unit, 16)) & 0xFFFFFFFF
    signed = h - (1 << 32) if h >= 1 << 31 else h
    return 0 if signed == -(1 << 31) else abs(signed)


class KafkaCluster:
    """``nodes`` brokers on ports ``port``.. (see cluster.sh for the layout), data under
    ``.local/private-<name>``."""

    def __init__(self, name: str, port: int, nodes: int = 3, proxied: int = 1) -> None:
        self.port = port
        self.nodes = nodes
        self.bootstrap = ",".join(f"127.0.0.1:{port + i}" for i in range(nodes))
        self._env = {
            **os.environ,
            "HARVESTER_LOCAL_DIR": str(ROOT / ".local" / f"private-{name}"),
            "KAFKA_CLUSTER_PORT": str(port),
            "KAFKA_CLUSTER_NODES": str(nodes),
            "KAFKA_CLUSTER_PROXIED": str(proxied),
            "KAFKA_JVM_OPTIONS": QUICK_JVM,
        }
        self._admin: AdminClient | None = None

    def _run(self, *args: str) -> None:
        subprocess.run(["bash", str(SCRIPT), *args], check=True, env=self._env, stdout=subprocess.DEVNULL)

    @property
    def admin(self) -> AdminClient:
        if self._admin is None:
            self._admin = AdminClient({"bootstrap.servers": self.bootstrap})
        return self._admin

    def start(self) -> None:
        """Start every node (those already running are left alone) and wait until all are in sync."""
        self._run("start")
        self.wait_in_sync()

    def stop(self) -> None:
        self._run("stop")

    def kill(self, node: int) -> None:
        """SIGKILL one broker."""
        self._run("kill-node", str(node))

    def start_node(self, node: int) -> None:
        self._run("start-node", str(node))

    def wait_in_sync(self, timeout: float = 180.0) -> None:
        """Wait until every node is registered and every partition's replicas are all in sync
        (a restarted broker has caught up), so the next fault starts from a whole cluster."""
        deadline = time.monotonic() + timeout
        while True:
            try:
                meta = self.admin.list_topics(timeout=10)
                lagging = [
                    f"{t}/{p}"
                    for t, tm in meta.topics.items()
                    for p, pm in tm.partitions.items()
                    if len(pm.isrs) < len(pm.replicas) or pm.leader < 0
                ]
                if len(meta.brokers) == self.nodes and not lagging:
                    return
            except KafkaException:
                lagging = ["(no metadata)"]
            if time.monotonic() > deadline:
                raise TimeoutError(f"cluster not in sync within {timeout:.0f}s: {lagging[:5]}")
            time.sleep(0.5)

    def leader_of(self, topic: str, partition: int) -> int:
        """The node leading ``topic``/``partition``."""
        return int(self.admin.list_topics(topic, timeout=10).topics[topic].partitions[partition].leader)

    def internal_leader(self, topic: str, key: str) -> int:
        """The node leading the partition of ``topic`` (an internal one) that holds ``key``."""
        deadline = time.monotonic() + 30
        while True:  # no leader (-1) while one is being elected after a broker died
            partitions = self.admin.list_topics(topic, timeout=10).topics[topic].partitions
            leader = int(partitions[java_hash(key) % len(partitions)].leader)
            if leader >= 0 or time.monotonic() > deadline:
                return leader
            time.sleep(0.5)

    def group_coordinator(self, group: str) -> int:
        """The node coordinating consumer group ``group``: the leader of the ``__consumer_offsets``
        partition that holds it. (Describing the group failed with NOT_COORDINATOR for over a minute
        after broker restarts in the soak.)"""
        return self.internal_leader("__consumer_offsets", group)

    def transaction_coordinator(self, transactional_id: str) -> int:
        """The node coordinating ``transactional_id`` (once a producer initialised transactions)."""
        return self.internal_leader("__transaction_state", transactional_id)

    def proxied_bootstrap(self, listener: int = 1) -> str:
        """A client bootstrapping here reaches every broker through the proxies of
        :meth:`proxied` for the same ``listener`` set."""
        return ",".join(f"127.0.0.1:{self.port + 20 * listener + 10 + i}" for i in range(self.nodes))

    @contextmanager
    def proxied(self, listener: int = 1) -> Iterator[ProxyGroup]:
        """One proxy per broker, forwarding the port its PROXIED<listener> listener advertises
        to that listener."""
        base = self.port + 20 * listener
        with ExitStack() as stack:
            proxies = [stack.enter_context(Proxy(("127.0.0.1", base + i), base + 10 + i)) for i in range(self.nodes)]
            yield ProxyGroup(proxies)


class ProxyGroup:
    """The proxies of every broker of a cluster, switched together."""

    def __init__(self, proxies: list[Proxy]) -> None:
        self.proxies = proxies

    def set_mode(self, mode: Mode) -> None:
        for p in self.proxies:
            p.set_mode(mode)

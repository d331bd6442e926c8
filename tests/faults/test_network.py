"""Network cuts (issue 22): the leader loses one path (Kafka, or PostgreSQL) while the others keep
theirs, through a TCP proxy only its process uses."""

from __future__ import annotations

import socket
import threading
import time
from collections.abc import Iterator
from contextlib import suppress

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harvester.core.identity import Identity, IdentityHeaders
from tests.chaos.harness import read_all
from tests.faults.cluster import KafkaCluster
from tests.faults.proxy import Mode, Proxy
from tests.faults.scenario import Scenario, exit_counters, settings
from tests.proc.processes import HarvesterProcess
from tests.support.kafka import consumed_headers
from tests.support.services import Services

pytestmark = [pytest.mark.integration]


# ------------------------------------------------------------------ the proxy itself


@pytest.fixture
def echo() -> Iterator[tuple[str, int]]:
    """A TCP echo server on a free port."""
    server = socket.create_server(("127.0.0.1", 0))

    def serve() -> None:
        while True:
            try:
                conn, _ = server.accept()
            except OSError:
                return
            threading.Thread(target=lambda c=conn: _echo(c), daemon=True).start()

    threading.Thread(target=serve, daemon=True).start()
    yield ("127.0.0.1", int(server.getsockname()[1]))
    server.close()


def _echo(conn: socket.socket) -> None:
    with conn, suppress(OSError):  # the proxy resets it in one case
        while data := conn.recv(4096):
            conn.sendall(data)


def _ask(sock: socket.socket, data: bytes, timeout: float = 5.0) -> bytes:
    sock.settimeout(timeout)
    sock.sendall(data)
    return sock.recv(4096)


def test_proxy_modes(echo: tuple[str, int]) -> None:
    with Proxy(echo, delay=0.01) as proxy:
        client = socket.create_connection(("127.0.0.1", proxy.port))
        assert _ask(client, b"a") == b"a"
        proxy.set_mode("slow")
        assert _ask(client, b"b") == b"b"
        proxy.set_mode("stall")
        with pytest.raises(TimeoutError):
            _ask(client, b"c", timeout=0.5)
        proxy.set_mode("pass")  # the stalled bytes flow on
        assert client.recv(4096) == b"c"
        proxy.set_mode("reset")
        with pytest.raises(ConnectionResetError):
            _ask(client, b"d")
        proxy.set_mode("cut")
        with pytest.raises(ConnectionRefusedError):
            socket.create_connection(("127.0.0.1", proxy.port))
        proxy.set_mode("pass")
        again = socket.create_connection(("127.0.0.1", proxy.port))
        assert _ask(again, b"e") == b"e"
        again.close()
        client.close()


# ------------------------------------------------------------------ cuts


@pytest.mark.timeout(300)
def test_leader_cut_from_kafka_yields_and_is_fenced(services: Services, whole_cluster: KafkaCluster) -> None:
    """The leader reaches the cluster (election and producer) through proxies that are cut: it
    yields, the other process takes over and fences it; nothing is lost, per-key order holds.

    Each process reaches the cluster through proxies of its own, and the one that leads at the cut
    is cut. The first need not lead by then: on a loaded machine a leader's own heartbeats can take
    longer than heartbeatTimeout to come back, and a leader fenced that way steps down to the other
    member (as it should), which then leads before the cut. Cutting the first process regardless
    made this test wait for a takeover that had already happened ("no takeover after the cut")."""
    s = settings()
    with (
        whole_cluster.proxied(1) as first,
        whole_cluster.proxied(2) as second,
        Scenario(s, services.pg_dsn, whole_cluster.bootstrap) as sc,
    ):
        a = sc.spawn_leader("cut-kafka-a", bootstrap=whole_cluster.proxied_bootstrap(1))
        b = sc.spawn("cut-kafka-b", bootstrap=whole_cluster.proxied_bootstrap(2))
        sc.wait_group(2)
        sc.writers.start()
        sc.wait_published(150)
        cut_off = leading([a, b])
        other, paths = (b, first) if cut_off is a else (a, second)
        cut = time.time()
        paths.set_mode("cut")
        assert other.wait_for("LeaderAcquired", 60.0, after=cut), "no takeover after the cut"
        # It yields on its own (its heartbeats stop coming back: LeaderFenced) or in a rebalance.
        assert cut_off.seen("LeaderFenced", cut) or cut_off.wait_for("LeaderRevoked", 10.0, after=cut)
        sc.wait_published(150)  # the new leader harvests
        paths.set_mode("pass")
        outcome = sc.finish()
        sc.group.stop()
        counters = exit_counters([cut_off])[cut_off.name]
        assert outcome.violations() == [], outcome.explain()
        # Its late purges (records acknowledged once the path healed) met the new leader's fence.
        assert counters.get("fenced_statements", 0) >= 1, (counters, outcome.explain())


def leading(procs: list[HarvesterProcess], timeout: float = 60.0) -> HarvesterProcess:
    """The one process of ``procs`` that leads now: its latest leadership event is LeaderAcquired.
    Waits while none does (a leader fenced, not yet taken over)."""
    deadline = time.monotonic() + timeout
    while True:
        leaders = [p for p in procs if latest_leadership(p) == "LeaderAcquired"]
        if len(leaders) == 1:
            return leaders[0]
        assert len(leaders) < 2, "two processes lead at once"
        assert time.monotonic() < deadline, f"nobody led within {timeout:.0f} s"
        time.sleep(0.1)


def latest_leadership(proc: HarvesterProcess) -> str | None:
    kinds = ("LeaderAcquired", "LeaderFenced", "LeaderRevoked")
    return next((e["event"] for e in reversed(list(proc.events)) if e["event"] in kinds), None)


@pytest.mark.timeout(300)
@pytest.mark.parametrize("mode", ["cut", "stall"])
def test_leader_cut_from_postgres_yields_to_one_that_reaches_it(services: Services, mode: Mode) -> None:
    """The leader keeps Kafka but loses PostgreSQL, its connections closed (``cut``) or left
    without an answer (``stall``, noticed after statementTimeout): it publishes no more than its
    in-flight window, and once its store calls have failed for heartbeatTimeout it steps down; the
    other process, whose path works, takes over. Nothing is lost, per-key order holds."""
    window = 20
    s = settings()
    pg = conninfo_to_dict(services.pg_dsn)
    target = (str(pg.get("host", "127.0.0.1")), int(str(pg.get("port") or 5432)))
    with (
        Proxy(target) as proxy,
        Scenario(s, services.pg_dsn, services.bootstrap, max_in_flight_records=window, statement_timeout="2s") as sc,
    ):
        proxied = make_conninfo(services.pg_dsn, host="127.0.0.1", port=proxy.port)
        cut_off = sc.spawn_leader("cut-pg-a", dsn=proxied)
        other = sc.spawn("cut-pg-b")
        sc.writers.start()
        sc.wait_published(150)
        cut = time.time()
        proxy.set_mode(mode)
        assert other.wait_for("LeaderAcquired", 60.0, after=cut), "no takeover after the cut"
        assert cut_off.seen("LeaderFenced", cut), "the cut leader did not step down"
        sc.wait_published(150)  # the new leader harvests
        takeover = min(e["t"] for e in other.events if e["event"] == "LeaderAcquired" and e["t"] >= cut) - cut
        purge = sc.first_purge_after(cut) or float("nan")
        print(f"{mode}: takeover {takeover:.1f} s, first purge {purge:.1f} s after the fault")
        proxy.set_mode("pass")
        outcome = sc.finish()
        assert outcome.violations() == [], outcome.explain()
        late = published_after(sc, cut, by_epochs_before=cut)
        assert late <= window, f"{late} records published by the cut leader after the cut (window {window})"


def published_after(sc: Scenario, wall: float, *, by_epochs_before: float) -> int:
    """Messages appended after ``wall`` (time.time()) by the leaders that published before
    ``by_epochs_before``: what a leader published once cut off."""
    names = IdentityHeaders()
    stamped = [
        (m.timestamp()[1] / 1000, identity.epoch)
        for m in read_all(sc.bootstrap, sc.topics, sc.settings.partitions, 120.0)
        if (identity := Identity.from_headers(consumed_headers(m), names)) is not None
    ]
    before = {epoch for at, epoch in stamped if at < by_epochs_before}
    return sum(1 for at, epoch in stamped if at >= wall and epoch in before)

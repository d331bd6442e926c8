"""statementTimeout on the store's own: a statement whose path stalls (the TCP proxy forwards
nothing, and keeps acknowledging, so TCP cannot tell) fails as an unreachable database within the
deadline instead of waiting forever, and the store works again once the path heals. The libpq
settings a DSN gives itself are kept. A standby cut from its database shows the stall too."""

from __future__ import annotations

import time
from collections.abc import Callable
from datetime import timedelta

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harvester import Harvester, HarvesterConfig, Limits
from harvester.core.protocols import StoreUnreachableError
from harvester.core.retries import PROBE
from harvester.postgres.deadline import tcp_settings
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.table.store import PostgresStore
from tests.faults.proxy import Proxy
from tests.support.harvesters import ManualElector
from tests.support.services import Services

pytestmark = [pytest.mark.integration]


def pg_target(services: Services) -> tuple[str, int]:
    pg = conninfo_to_dict(services.pg_dsn)
    return str(pg.get("host", "127.0.0.1")), int(str(pg.get("port") or 5432))


def test_a_stalled_statement_fails_as_unreachable_and_the_store_recovers(services: Services, outbox: TableName) -> None:
    with Proxy(pg_target(services)) as proxy:
        dsn = make_conninfo(services.pg_dsn, host="127.0.0.1", port=proxy.port)
        store = PostgresStore.open(dsn, outbox, statement_timeout=1.0)
        try:
            assert store.head() == (0, None)
            proxy.set_mode("stall")
            with pytest.raises(StoreUnreachableError, match=r"no answer within statementTimeout \(1 s\)"):
                store.head()
            proxy.set_mode("pass")
            assert store.head() == (0, None)  # a new connection
        finally:
            store.close()


def test_tcp_settings_follow_the_timeout_and_yield_to_the_dsn() -> None:
    assert tcp_settings("host=db", 0) == {}
    assert tcp_settings("host=db", 60) == {
        "keepalives": 1,
        "keepalives_idle": 30,
        "keepalives_interval": 10,
        "keepalives_count": 3,
        "tcp_user_timeout": 60_000,
    }
    assert "tcp_user_timeout" not in tcp_settings("host=db tcp_user_timeout=5000", 60)


def test_a_standby_cut_from_its_database_stalls_until_the_path_heals(services: Services, outbox: TableName) -> None:
    """A standby runs no statement of its own: its backlog sample doubles as a probe of the path, so
    a standby cut from PostgreSQL (a leader that stepped down, say) stalls ``/healthz`` as a leader
    would, and the stall clears once the path heals."""
    with Proxy(pg_target(services)) as proxy:
        config = HarvesterConfig(
            data_source=make_conninfo(services.pg_dsn, host="127.0.0.1", port=proxy.port),
            outbox_table=outbox.qualified,
            base_kafka_config={"bootstrap.servers": services.bootstrap},
            limits=Limits(min_metrics_interval=timedelta(milliseconds=100), stall_timeout=timedelta(milliseconds=300)),
        )
        h = Harvester(config, elector=ManualElector(leader=False))
        h.start()
        try:
            assert h.alive
            proxy.set_mode("cut")
            assert _eventually(lambda: h.stalled is not None), "no stall while cut from the database"
            stall = h.stalled
            assert stall is not None and stall.operation == PROBE and not h.alive, stall
            proxy.set_mode("pass")
            assert _eventually(lambda: h.stalled is None), f"still stalled once the path healed: {h.stalled}"
            assert h.alive
        finally:
            h.stop(timeout=5)


def _eventually(check: Callable[[], bool], timeout: float = 60.0) -> bool:
    deadline = time.monotonic() + timeout
    while not check():
        if time.monotonic() > deadline:
            return False
        time.sleep(0.05)
    return True

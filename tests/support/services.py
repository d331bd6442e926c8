"""The shared PostgreSQL and Kafka the tests use: given, started by testcontainers, or started
locally by deploy/local/services.sh."""

from __future__ import annotations

import os
import subprocess
from dataclasses import dataclass
from typing import Any

from tests.support.paths import SERVICES


@dataclass(frozen=True)
class Services:
    """Where the test services listen."""

    pg_dsn: str
    bootstrap: str

    def kafka(self, **extra: Any) -> dict[str, Any]:
        return {"bootstrap.servers": self.bootstrap, **extra}


def ensure_services() -> Services:
    """Start (or find) PostgreSQL and Kafka.

    - ``HARVESTER_TEST_PG_DSN`` and ``HARVESTER_TEST_KAFKA``: use those existing services.
    - ``HARVESTER_TEST_TESTCONTAINERS=1``: start both with testcontainers (needs a Docker engine).
    - otherwise: ``deploy/local/services.sh start`` (idempotent).
    """
    dsn, bootstrap = os.environ.get("HARVESTER_TEST_PG_DSN"), os.environ.get("HARVESTER_TEST_KAFKA")
    if dsn and bootstrap:
        return Services(dsn, bootstrap)
    if os.environ.get("HARVESTER_TEST_TESTCONTAINERS") == "1":
        return _testcontainers()
    subprocess.run(["bash", str(SERVICES), "start"], check=True, stdout=subprocess.DEVNULL)
    pgport = os.environ.get("PGPORT", "5432")
    kport = os.environ.get("KAFKA_PORT", "9092")
    return Services(
        f"host=127.0.0.1 port={pgport} user=harvester password=local-dev-secret dbname=harvester",
        f"127.0.0.1:{kport}",
    )


def _testcontainers() -> Services:
    from testcontainers.kafka import KafkaContainer
    from testcontainers.postgres import PostgresContainer

    password = "local-dev-secret"  # the same as the local services', so one DSN shape serves both
    pg = PostgresContainer("postgres:16", username="harvester", password=password, dbname="harvester")
    kafka = KafkaContainer("confluentinc/cp-kafka:7.6.0").with_kraft()
    pg.start()
    kafka.start()
    host, port = pg.get_container_host_ip(), pg.get_exposed_port(5432)
    return Services(
        f"host={host} port={port} user=harvester password={password} dbname=harvester",
        kafka.get_bootstrap_server(),
    )

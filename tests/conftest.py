"""Fixtures: real PostgreSQL and Kafka (started on demand), an isolated outbox and topics per test."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harvester import HarvesterConfig, Limits
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import migrate
from tests.support.harvesters import HarvesterFactory, harvesters
from tests.support.kafka import create_topics, delete_topics
from tests.support.names import unique
from tests.support.private_services import PrivateKafka
from tests.support.services import Services, ensure_services

# `./dev.sh test` runs two pytest-xdist workers. Tests that share something fixed (private services
# on fixed ports or directories, the Spark cluster, the restartable broker, the reaper's default HTTP
# port) form one group, run by one worker one after another; every other test (its own schema, its
# own topics) is a group of its own. The longest groups go first, so that no worker is left alone
# with one at the end: the scheduler hands out groups in the collection's order, which
# pytest_collection_modifyitems sorts by _GROUPS, not by xdist's default (most tests first, which put
# the reaper's 180 short tests before the Spark and chaos groups, and chaos sixth). (xdist's own
# `loadgroup` marks do not reach its scheduler under pytest 9.)
_GROUPS = (  # path prefix -> group, longest first
    ("tests/spark", "spark"),  # tests/spark and tests/spark_drain: one Spark cluster, fixed ports
    ("tests/chaos/test_chaos.py", "chaos"),
    ("tests/faults/", "faults"),
    ("tests/reaper/", "reaper"),
    ("tests/secure/", "secure"),
    ("tests/compat/", "compat"),
    ("tests/packaging/", "packaging"),  # out of the reaper group: its first run downloads a venv per Python
    ("tests/deadletter/test_poison.py", "private_kafka"),  # these use the private_kafka broker
    ("tests/engine/test_failures.py", "private_kafka"),
    ("tests/leader/test_failover.py", "private_kafka"),
    ("tests/leader/test_group_members.py", "private_kafka"),
    # Its two cases share one private server (a module fixture, a fixed directory): one worker.
    ("tests/log/test_invalidated_slot.py", "invalidated_slot"),
)


def _group(nodeid: str) -> tuple[int, str]:
    for rank, (prefix, group) in enumerate(_GROUPS):
        if nodeid.startswith(prefix):
            return rank, group
    return len(_GROUPS), nodeid


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    items.sort(key=lambda item: _group(item.nodeid)[0])  # stable: the groups' own order is kept


def pytest_xdist_make_scheduler(config: pytest.Config, log: Any) -> Any:
    from xdist.scheduler import LoadScopeScheduling

    config.option.loadscopereorder = False  # keep the collection's order (see _GROUPS)

    class Groups(LoadScopeScheduling):  # type: ignore[misc]  # xdist is untyped
        def _split_scope(self, nodeid: str) -> str:
            return _group(nodeid)[1]

    return Groups(config, log)


@pytest.fixture(scope="session")
def services() -> Services:
    return ensure_services()


@pytest.fixture
def pg(services: Services) -> Iterator[psycopg.Connection[tuple[object, ...]]]:
    """An autocommit connection to the test database."""
    with psycopg.connect(services.pg_dsn, autocommit=True) as conn:
        yield conn


@pytest.fixture
def schema(pg: psycopg.Connection[tuple[object, ...]]) -> Iterator[str]:
    """A schema of this test's own, dropped afterwards."""
    name = unique("t")
    pg.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    yield name
    pg.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


@pytest.fixture
def outbox(pg: psycopg.Connection[tuple[object, ...]], schema: str) -> TableName:
    """A migrated goharvest-layout outbox table in this test's schema."""
    table = TableName(schema, "outbox")
    migrate(pg, table)
    return table


@pytest.fixture
def topics(services: Services) -> Iterator[Callable[..., str]]:
    """Factory of unique topics (created now, deleted after the test)."""
    made: list[str] = []

    def make(partitions: int = 1, **config: str) -> str:
        name = unique("topic")
        create_topics(services.bootstrap, [name], partitions, **config)
        made.append(name)
        return name

    yield make
    delete_topics(services.bootstrap, made)


@pytest.fixture(scope="session")
def secure() -> None:
    """``deploy/local/services.sh start-secure``'s services (tests/secure and the Spark group's secure
    test: either worker may start them first)."""
    from tests.secure import services as secure_services

    secure_services.start()


@pytest.fixture(scope="session")
def private_kafka() -> Iterator[PrivateKafka]:
    """A second broker (port 19092) for tests that restart Kafka; stopped at the end of the session."""
    broker = PrivateKafka("restart", 19092)
    broker.start()
    yield broker
    broker.stop()


@pytest.fixture
def make_harvester(services: Services, outbox: TableName) -> Iterator[HarvesterFactory]:
    """Build (and afterwards stop) harvesters on this test's outbox; keyword args tune limits."""

    def config(
        *,
        bootstrap: str | None = None,
        producer: dict[str, Any] | None = None,
        settings: dict[str, Any] | None = None,
        **limits: Any,
    ) -> HarvesterConfig:
        return HarvesterConfig(
            data_source=services.pg_dsn,
            outbox_table=outbox.qualified,
            base_kafka_config={"bootstrap.servers": bootstrap or services.bootstrap},
            producer_kafka_config=producer or {},
            limits=Limits(**{"io_error_backoff": "100ms", **limits}),
            **(settings or {}),
        )

    with harvesters(config) as make:
        yield make

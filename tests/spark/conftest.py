"""One local SparkSession for the whole test session, with the ``outbox`` data source registered; a
standalone cluster, Spark Connect servers (one in local mode, one on the cluster) and the packages
shipped to them."""

from __future__ import annotations

import shutil
import zipfile
from collections.abc import Iterator
from pathlib import Path

import pytest
from pyspark import cloudpickle
from pyspark.sql import SparkSession

from harvester.postgres.schema.identifiers import TableName
from tests.spark import faults
from tests.spark.cluster import (
    ConnectServer,
    StandaloneCluster,
    bare_environment,
    base_port,
    local_session,
    packed_environment,
)
from tests.spark.drivers import SharedDriver
from tests.support.paths import ROOT
from tests.support.services import Services
from tests.support.wheel import build_wheel


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """:func:`local_session`, and the fault-injecting source."""
    session = local_session("harvester-tests")
    # Ship the fault-injecting source by value: Python workers need not find the tests package.
    cloudpickle.register_pickle_by_value(faults)  # type: ignore[no-untyped-call]
    session.dataSource.register(faults.FaultyOutbox)
    yield session
    session.stop()


@pytest.fixture
def sink(services: Services, outbox: TableName) -> dict[str, str]:
    """The options that point the ``outbox`` data source at this test's outbox table."""
    return {"dsn": services.pg_dsn, "table": outbox.qualified}


@pytest.fixture(scope="session", autouse=True)
def _boot_early(request: pytest.FixtureRequest) -> None:
    """Start the JVMs that the selected tests will need (the cluster with the shared driver, the
    Connect server) before the first of these tests runs, without waiting for them: each takes tens
    of seconds to boot on two loaded cores, and they boot while the local-mode tests run."""
    here = Path(__file__).parent
    mine = [item for item in request.session.items if here in item.path.parents]  # not a namesake elsewhere
    wanted = {name for item in mine for name in getattr(item, "fixturenames", ())}
    for name in ("connect_server", "cluster_connect", "driver"):  # those that block (building the wheel) last
        if name in wanted:
            request.getfixturevalue(name)


@pytest.fixture(scope="session")
def spark_cluster(tmp_path_factory: pytest.TempPathFactory) -> Iterator[StandaloneCluster]:
    """A master and two workers from pyspark's distribution, on loopback, booting (see
    :meth:`StandaloneCluster.start`); stopped at the end."""
    cluster = StandaloneCluster(tmp_path_factory.mktemp("spark-cluster"), base_port())
    try:
        cluster.start()
        yield cluster
    finally:
        cluster.stop()


@pytest.fixture(scope="session")
def driver(
    spark_cluster: StandaloneCluster, shipped: list[Path], tmp_path_factory: pytest.TempPathFactory
) -> Iterator[SharedDriver]:
    """The tests' shared driver on the cluster, shipped the ``--py-files`` way; returned while it boots
    (its first scenario waits for it)."""
    # Both workers first (they boot while the wheel is built): an application that registers while
    # only one is there takes both of its executors on that one.
    spark_cluster.wait_for_workers(len(spark_cluster.workers))
    shared = SharedDriver(spark_cluster, shipped, tmp_path_factory.mktemp("driver"))
    try:
        yield shared
    finally:
        shared.stop()


@pytest.fixture(scope="session")
def shipped(tmp_path_factory: pytest.TempPathFactory) -> list[Path]:
    """What the cluster tests pass with ``--py-files``: this project's wheel, built now, as a .zip
    (Spark puts only .zip, .egg and .py files on the Python path), and the tests' fault-injecting
    source and jobs."""
    tmp = tmp_path_factory.mktemp("shipped")
    package = tmp / "outbox_harvester.zip"
    shutil.copyfile(build_wheel(tmp), package)
    testkit = tmp / "testkit.zip"
    with zipfile.ZipFile(testkit, "w") as kit:
        for name in ("tests/__init__.py", "tests/spark/__init__.py", "tests/spark/faults.py", "tests/spark/jobs.py"):
            kit.write(ROOT / name, name)
    return [package, testkit]


@pytest.fixture(scope="session")
def packed_env(tmp_path_factory: pytest.TempPathFactory, shipped: list[Path]) -> tuple[Path, Path]:
    """The package in a packed virtual environment, for ``spark.archives``: the environment (whose
    Python a driver runs) and its archive (which executors unpack)."""
    return packed_environment(shipped[0], tmp_path_factory.mktemp("packed"))


@pytest.fixture(scope="session")
def connect_server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[ConnectServer]:
    """A Spark Connect server in local mode, on loopback, booting (see :meth:`ConnectServer.wait`);
    stopped at the end."""
    server = ConnectServer(tmp_path_factory.mktemp("spark-connect"), base_port())
    try:
        server.launch()
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="session")
def cluster_connect(
    spark_cluster: StandaloneCluster, tmp_path_factory: pytest.TempPathFactory
) -> Iterator[ConnectServer]:
    """A Spark Connect server on the standalone cluster, booting, whose Python workers (its own and
    the executors') run an environment without the package: a client's session artifact is all
    that provides it."""
    root = tmp_path_factory.mktemp("spark-connect-cluster")
    python = bare_environment(root / "python") / "bin" / "python"
    server = ConnectServer(root, base_port(), spark_cluster.url, {"spark.pyspark.python": str(python)}, slot=1)
    try:
        server.launch()
        yield server
    finally:
        server.stop()

"""One local SparkSession for the whole test session, with the ``outbox`` data source registered."""

from __future__ import annotations

import os
import sys
from collections.abc import Iterator

import pytest
from pyspark import cloudpickle
from pyspark.sql import SparkSession

from examples.spark_pipeline import KAFKA_PACKAGE
from harvester.postgres.identifiers import TableName
from harvester.spark import register
from tests.spark import faults
from tests.support import Services


@pytest.fixture(scope="session")
def spark() -> Iterator[SparkSession]:
    """``local[2,2]``: two cores, and a failed task is retried once (local mode's default is never),
    which the failure-injection tests rely on."""
    # Python workers must run this interpreter, which has harvester, psycopg and pyarrow.
    os.environ["PYSPARK_PYTHON"] = sys.executable
    session = (
        SparkSession.builder.master("local[2,2]")
        .appName("harvester-tests")
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.streaming.stopTimeout", "10s")
        .config("spark.driver.memory", "1g")
        # The example pipeline's Kafka source; loaded here so that its test shares this session.
        .config("spark.jars.packages", KAFKA_PACKAGE)
        .getOrCreate()
    )
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    # Ship the fault-injecting source by value: Python workers need not find the tests package.
    cloudpickle.register_pickle_by_value(faults)  # type: ignore[no-untyped-call]
    session.dataSource.register(faults.FaultyOutbox)
    yield session
    session.stop()


@pytest.fixture
def sink(services: Services, outbox: TableName) -> dict[str, str]:
    """The options that point the ``outbox`` data source at this test's outbox table."""
    return {"dsn": services.pg_dsn, "table": outbox.qualified}

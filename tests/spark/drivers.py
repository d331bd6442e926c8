"""Drivers submitted to the test cluster with ``spark-submit``: one a test starts (and may kill), and
the long-lived shared one that runs the scenarios of every test that does not kill its driver."""

from __future__ import annotations

import json
import subprocess
import time
from collections.abc import Callable
from pathlib import Path
from typing import Any

from examples.spark_pipeline import KAFKA_PACKAGE
from tests.spark.cluster import StandaloneCluster, kill_tree, spark_submit
from tests.support.names import unique

JOB = Path(__file__).with_name("cluster_job.py")
DRIVER_SECONDS = 480.0
LOST_ROWS = 8_000  # the executor-loss write: four partitions of two Arrow batches each


class Driver:
    """One ``spark-submit`` of ``cluster_job.py`` to the test cluster."""

    def __init__(
        self,
        cluster: StandaloneCluster,
        shipped: list[Path],
        scenario: str,
        config: dict[str, Any],
        env: dict[str, str] | None = None,
        conf: dict[str, str] | None = None,
        cwd: Path | None = None,
    ) -> None:
        self.cluster = cluster
        self.log = Path(config["result"]).with_suffix(".log")
        self.result = Path(config["result"])
        settings = {
            **cluster.driver_conf(),
            "spark.task.maxFailures": "2",  # as the local session's local[2,2]
            # Two Arrow batches per partition of the executor-loss write, with few rows.
            "spark.sql.execution.arrow.maxRecordsPerBatch": str(LOST_ROWS // 8),
            **(conf or {}),
        }
        self.process = spark_submit(
            {**cluster.env, **(env or {})},
            cluster.url,
            JOB,
            [scenario, json.dumps(config)],
            shipped,
            settings,
            self.log,
            cwd,
        )

    def failure(self) -> str:
        """The end of the driver's output, for an assertion message."""
        return self.log.read_text(errors="replace")[-4000:]

    def finish(self) -> dict[str, Any]:
        """Wait for the driver to succeed; return its result."""
        try:
            code = self.process.wait(timeout=DRIVER_SECONDS)
        except subprocess.TimeoutExpired:
            kill_tree(self.process.pid)
            raise AssertionError(f"the driver did not finish:\n{self.failure()}") from None
        assert code == 0, self.failure()
        result: dict[str, Any] = json.loads(self.result.read_text())
        return result

    def wait_for(self, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` while the driver runs."""
        deadline = time.monotonic() + DRIVER_SECONDS
        while not done():
            assert self.process.poll() is None, f"the driver exited early:\n{self.failure()}"
            self.cluster.check()
            assert time.monotonic() < deadline, f"timed out:\n{self.failure()}"
            time.sleep(0.2)

    def kill(self) -> None:
        """SIGKILL the driver (spark-submit's JVM and the Python driver under it), as a crash would."""
        kill_tree(self.process.pid)
        self.process.wait()


class SharedDriver:
    """The long-lived ``serve`` driver that runs the scenarios of every test that does not kill its
    driver: one driver JVM and one executor per worker for all of them."""

    def __init__(self, cluster: StandaloneCluster, shipped: list[Path], root: Path) -> None:
        self.inbox = root / "inbox"
        self.inbox.mkdir()
        settings = {"inbox": str(self.inbox), "result": str(root / "serve.json")}
        # Spark's Kafka sink, for the drain's scenario (resolved from Maven Central, as users do).
        self.driver = Driver(cluster, shipped, "serve", settings, conf={"spark.jars.packages": KAFKA_PACKAGE})

    def start(self, scenario: str, config: dict[str, Any]) -> Path:
        """Hand ``scenario`` to the driver; return where its result will be."""
        request = self.inbox / unique("job")
        request.with_suffix(".part").write_text(json.dumps({"scenario": scenario, "config": config}))
        request.with_suffix(".part").rename(request.with_suffix(".json"))
        return request.with_suffix(".result")

    def finish(self, result: Path) -> dict[str, Any]:
        """Wait for a scenario's result; fail if the scenario raised."""
        self.driver.wait_for(result.exists)
        done: dict[str, Any] = json.loads(result.read_text())
        assert "error" not in done, done["error"]
        return done

    def wait_for(self, result: Path, done: Callable[[], bool]) -> None:
        """Wait until ``done()`` while the scenario answering at ``result`` runs; fail at once with the
        scenario's error if it ends first (a failed query would otherwise be waited for in vain)."""
        self.driver.wait_for(lambda: done() or result.exists())
        if not done():
            self.finish(result)
            raise AssertionError(f"the scenario ended before the test's condition: {result.read_text()}")

    def run(self, scenario: str, config: dict[str, Any]) -> dict[str, Any]:
        """Run ``scenario`` and return its result."""
        return self.finish(self.start(scenario, config))

    def stop(self) -> None:
        """Let the driver finish."""
        (self.inbox / "stop").touch()
        self.driver.finish()

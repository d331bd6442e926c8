"""This project's wheel, built from a copy of the checkout (once per test session)."""

from __future__ import annotations

import fcntl
import os
import shutil
import subprocess
import sys
from importlib.metadata import version
from pathlib import Path
from typing import TYPE_CHECKING

from tests.support.paths import ROOT

if TYPE_CHECKING:
    import pytest

# Build and tool state at the top of the checkout (.gitignore's entries), never part of a build.
LOCAL_STATE = {
    ".git",
    ".venv",
    ".local",
    ".ci",
    ".mypy_cache",
    ".ruff_cache",
    ".pytest_cache",
    ".hypothesis",
    "build",
    "dist",
    "spark-warehouse",
    "metastore_db",
    "derby.log",
}


def _skip_local_state(directory: str, names: list[str]) -> set[str]:
    top = Path(directory) == ROOT
    return {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info")) or (top and n in LOCAL_STATE)}


def build_wheel(tmp: Path) -> Path:
    """This project's wheel, built under ``tmp`` from a copy of the checkout: an in-tree build would
    write build/ and *.egg-info into the working tree, and a stale build/lib there could put files
    into the wheel that the package-data configuration no longer selects."""
    setuptools_major = int(version("setuptools").split(".")[0])
    assert setuptools_major >= 77, "building with --no-build-isolation needs setuptools>=77 (the dev extra has it)"
    src, out = tmp / "src", tmp / "out"
    shutil.copytree(ROOT, src, ignore=_skip_local_state)
    done = subprocess.run(
        [sys.executable, "-m", "pip", "wheel", "--no-deps", "--no-build-isolation", "-q", "-w", str(out), str(src)],
        capture_output=True,
        text=True,
        timeout=180,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    (built,) = out.glob("*.whl")
    return built


def session_wheel(tmp_path_factory: pytest.TempPathFactory) -> Path:
    """:func:`build_wheel`'s wheel, built once per test session: pytest-xdist's workers share the
    session's temporary directory (their own are under it), and the first to need the wheel builds it
    there while the others wait on a lock (tests/reaper and tests/packaging, two groups, both test it)."""
    shared = tmp_path_factory.getbasetemp()
    if os.environ.get("PYTEST_XDIST_WORKER"):
        shared = shared.parent
    with (shared / "wheel.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        built = sorted((shared / "wheel" / "out").glob("*.whl"))
        return built[0] if built else build_wheel(shared / "wheel")

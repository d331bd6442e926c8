"""The wheel: PEP 639 license metadata, the LICENSE file, the one-source version and the package data.

The wheel is built from a copy of the checkout: an in-tree build would write build/ and *.egg-info
into the working tree, and a stale build/lib there could put files into the wheel that the
package-data configuration no longer selects.
"""

from __future__ import annotations

import hashlib
import shutil
import subprocess
import sys
import zipfile
from email.message import Message
from email.parser import HeaderParser
from importlib.metadata import version
from pathlib import Path

import pytest

import harvester
from tests.support import ROOT

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
# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt (also Debian's /usr/share/common-licenses/Apache-2.0).
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
MIGRATIONS = sorted((ROOT / "harvester" / "postgres" / "sql").glob("*.sql"))


def _skip_local_state(directory: str, names: list[str]) -> set[str]:
    top = Path(directory) == ROOT
    return {n for n in names if n == "__pycache__" or n.endswith((".pyc", ".egg-info")) or (top and n in LOCAL_STATE)}


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    setuptools_major = int(version("setuptools").split(".")[0])
    assert setuptools_major >= 77, "building with --no-build-isolation needs setuptools>=77 (the dev extra has it)"
    tmp = tmp_path_factory.mktemp("wheel")
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
    return zipfile.ZipFile(built)


def dist_info(wheel: zipfile.ZipFile) -> str:
    (name,) = {n.split("/", 1)[0] for n in wheel.namelist() if n.split("/", 1)[0].endswith(".dist-info")}
    return name


def metadata(wheel: zipfile.ZipFile) -> Message:
    return HeaderParser().parsestr(wheel.read(f"{dist_info(wheel)}/METADATA").decode())


@pytest.mark.unit
def test_license_file_is_the_apache_license_2_0() -> None:
    text = (ROOT / "LICENSE").read_bytes()
    assert hashlib.sha256(text).hexdigest() == APACHE_2_0_SHA256, "LICENSE is not the verbatim Apache License 2.0"


@pytest.mark.integration
def test_metadata_declares_the_spdx_license_and_the_package_version(wheel: zipfile.ZipFile) -> None:
    meta = metadata(wheel)
    assert meta["Name"] == "outbox-harvester"
    assert meta["Version"] == harvester.__version__
    assert Path(wheel.filename or "").name.startswith(f"outbox_harvester-{harvester.__version__}-")
    assert dist_info(wheel) == f"outbox_harvester-{harvester.__version__}.dist-info"
    assert meta["License-Expression"] == "Apache-2.0"
    assert meta.get_all("License-File") == ["LICENSE"]
    assert meta["License"] is None, "the SPDX expression replaces the free-text License field"
    classifiers = meta.get_all("Classifier") or []
    assert not [c for c in classifiers if c.startswith("License ::")], "PEP 639: no license classifier"
    assert "Programming Language :: Python :: 3 :: Only" in classifiers
    assert "outbox" in (meta["Keywords"] or "").split(",")


@pytest.mark.integration
def test_wheel_ships_the_license(wheel: zipfile.ZipFile) -> None:
    assert wheel.read(f"{dist_info(wheel)}/licenses/LICENSE") == (ROOT / "LICENSE").read_bytes()


@pytest.mark.integration
def test_wheel_ships_every_migration_and_the_typing_markers(wheel: zipfile.ZipFile) -> None:
    assert MIGRATIONS, "the checkout has migrations"
    names = set(wheel.namelist())
    shipped = sorted(n for n in names if n.startswith("harvester/postgres/sql/") and n.endswith(".sql"))
    assert shipped == [f"harvester/postgres/sql/{p.name}" for p in MIGRATIONS]
    for p in MIGRATIONS:
        assert wheel.read(f"harvester/postgres/sql/{p.name}") == p.read_bytes()
    assert {"harvester/py.typed", "leader/py.typed"} <= names

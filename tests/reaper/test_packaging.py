"""The wheel: PEP 639 license metadata, the LICENSE file, the one-source version, the package data, and
``reaper migrate`` run from the installed wheel.

The wheel is built from a copy of the checkout (``tests.support.build_wheel``).
"""

from __future__ import annotations

import hashlib
import os
import subprocess
import sys
import zipfile
from email.message import Message
from email.parser import HeaderParser
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

import harvester
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import applied
from tests.support import ROOT, Services, build_wheel

# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt (also Debian's /usr/share/common-licenses/Apache-2.0).
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
MIGRATIONS = sorted((ROOT / "sql").glob("*.sql"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return zipfile.ZipFile(build_wheel(tmp_path_factory.mktemp("wheel")))


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


@pytest.mark.integration
def test_reaper_migrate_runs_from_the_installed_wheel(
    wheel: zipfile.ZipFile,
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    tmp_path: Path,
) -> None:
    """The wheel installed into a directory of its own (its dependencies are this interpreter's), its
    ``reaper`` script run outside the checkout: the migrations it applies are the ones it carries."""
    site = tmp_path / "site"
    install = [sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-index", "--target", str(site)]
    subprocess.run([*install, str(wheel.filename)], check=True, capture_output=True, timeout=120)
    env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")} | {"PYTHONPATH": str(site)}
    where = subprocess.run(
        [sys.executable, "-c", "from harvester.postgres.schema import migrations as m; print(m._directory())"],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=60, check=True,
    )  # fmt: skip
    assert where.stdout.strip() == str(site / "harvester" / "postgres" / "sql")
    config = tmp_path / "reaper.yaml"
    config.write_text(f"harvest:\n  dataSource: {services.pg_dsn}\n  outboxTable: {schema}.outbox\n")
    done = subprocess.run(
        [str(site / "bin" / "reaper"), "migrate", "-f", str(config)],
        env=env, cwd=tmp_path, capture_output=True, text=True, timeout=120, check=False,
    )  # fmt: skip
    assert done.returncode == 0, done.stderr
    table = TableName(schema, "outbox")
    assert applied(pg, table) == [p.stem for p in MIGRATIONS]
    assert pg.execute(sql.SQL("SELECT count(*) FROM {}").format(table.ident)).fetchone() == (0,)

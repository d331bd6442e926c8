"""The wheel: PEP 639 license metadata, the LICENSE file, the one-source version, the package data,
``reaper migrate`` run from the installed wheel; every imported third-party module declared; the project's
URLs and ``reaper --help``'s links on files of the repository. The wheel on each Python it claims:
tests/packaging/test_pythons.py.

The wheel is built from a copy of the checkout, once per test session (``tests.support.wheel.session_wheel``).
"""

from __future__ import annotations

import argparse
import hashlib
import os
import re
import subprocess
import sys
import tomllib
import zipfile
from email.message import Message
from email.parser import HeaderParser
from importlib.metadata import packages_distributions
from pathlib import Path

import psycopg
import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from psycopg import sql

import harvester
from harvester.daemon import cli
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import applied
from tests.reaper.test_docs import anchors
from tests.support.paths import ROOT
from tests.support.services import Services
from tests.support.wheel import session_wheel

# sha256 of https://www.apache.org/licenses/LICENSE-2.0.txt (also Debian's /usr/share/common-licenses/Apache-2.0).
APACHE_2_0_SHA256 = "cfc7749b96f63bd31c3c42b5c471bf756814053e847c10f3eb003417bc523d30"
MIGRATIONS = sorted((ROOT / "sql").glob("*.sql"))


@pytest.fixture(scope="module")
def wheel(tmp_path_factory: pytest.TempPathFactory) -> zipfile.ZipFile:
    return zipfile.ZipFile(session_wheel(tmp_path_factory))


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


PROJECT = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
REPOSITORY = PROJECT["urls"]["Repository"]


def linked_file(url: str) -> Path:
    """The file of this checkout a URL of the project's names (``<repository>/blob/main/<path>[#anchor]``),
    its anchor checked too; the repository itself and its issues are the checkout's root."""
    assert url.startswith(REPOSITORY), f"{url} is not under {REPOSITORY}"
    rest = url.removeprefix(REPOSITORY)
    if rest in ("", "/issues"):
        return ROOT
    path, _, anchor = rest.removeprefix("/blob/main/").partition("#")
    assert rest.startswith("/blob/main/") and (ROOT / path).is_file(), f"{url}: no {path} in the repository"
    assert not anchor or anchor in anchors(ROOT / path), f"{url}: no heading #{anchor} in {path}"
    return ROOT / path


def urls(text: str) -> list[str]:
    return re.findall(r"https?://[^\s)'\"]+", text)


def all_help(parser: argparse.ArgumentParser) -> str:
    """The help of ``parser`` and of every subcommand under it."""
    texts = [parser.format_help()]
    for action in parser._actions:
        if isinstance(action, argparse._SubParsersAction):
            texts += [all_help(sub) for sub in action.choices.values()]
    return "\n".join(texts)


@pytest.mark.unit
def test_project_urls_and_the_help_links_are_files_of_the_repository() -> None:
    assert set(PROJECT["urls"]) == {"Homepage", "Repository", "Documentation", "Changelog", "Issues"}
    for url in PROJECT["urls"].values():
        linked_file(url)
    assert cli.DOCS.startswith(REPOSITORY)
    links = urls(all_help(cli._parser()))
    assert {linked_file(u).name for u in links} >= {"reaper.md", "security.md", "writers.md"}


IMPORT = re.compile(
    r"^[ \t]*(?:from[ \t]+(\w[\w.]*)[ \t]+import\b|import[ \t]+(\w[\w.]*)(?:[ \t]+as[ \t]+\w+)?[ \t]*$)", re.M
)


def imported_modules(top: str) -> dict[str, list[str]]:
    """{top-level third-party module: files importing it} under ``top`` (import statements read by a
    pattern, not parsed: parsing every file takes seconds)."""
    files = list((ROOT / top).rglob("*.py"))
    benches = {p.stem for p in (ROOT / "bench").glob("*.py")}  # tests/debezium imports the Connect set-up
    local = {p.stem for p in files} | benches | {"harvester", "leader", "tests", "bench", "examples", "__future__"}
    found: dict[str, list[str]] = {}
    for path in files:
        for match in IMPORT.finditer(path.read_text()):
            root = (match.group(1) or match.group(2)).split(".")[0]
            if root not in sys.stdlib_module_names and root not in local:
                found.setdefault(root, []).append(str(path.relative_to(ROOT)))
    return found


@pytest.mark.unit
def test_every_imported_third_party_module_is_declared() -> None:
    """The package's imports are in its dependencies or an extra other than dev; the tests', benches' and
    examples' in those or dev. A module only some dependency brings along (numpy with pyarrow) is not
    declared: an upgrade of that dependency could drop it."""
    declared: dict[str, set[str]] = {"": {canonicalize_name(Requirement(r).name) for r in PROJECT["dependencies"]}}
    for extra, requirements in PROJECT["optional-dependencies"].items():
        declared[extra] = {canonicalize_name(Requirement(r).name) for r in requirements}
    shipped = set().union(*(names for extra, names in declared.items() if extra != "dev"))
    everything = set().union(*declared.values())
    providers = packages_distributions()
    missing = []
    for top, allowed in (("harvester", shipped), ("leader", shipped), ("tests", everything), ("bench", everything),
                         ("examples", everything)):  # fmt: skip
        for module, files in imported_modules(top).items():
            dists = {canonicalize_name(d) for d in providers.get(module, [module])}
            if not dists & allowed:
                missing.append(f"{module} ({', '.join(sorted(dists))}) imported by {files[0]}")
    assert not missing

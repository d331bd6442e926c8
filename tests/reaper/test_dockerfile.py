"""The Dockerfile, checked without a Docker engine: its structure, and its build stage replayed in a venv."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry

from harvester.daemon.http import HttpServer
from harvester.daemon.settings import HttpSettings
from tests.support import ROOT

DOCKERFILE = ROOT / "Dockerfile"


def instructions() -> list[tuple[str, str]]:
    """(INSTRUCTION, arguments) pairs, continuation lines joined, comments dropped."""
    out: list[tuple[str, str]] = []
    pending = ""
    for raw in DOCKERFILE.read_text().splitlines():
        line = raw.strip()
        if not pending and (not line or line.startswith("#")):
            continue
        if line.endswith("\\"):
            pending += line[:-1] + " "
            continue
        full = pending + line
        pending = ""
        word, _, rest = full.partition(" ")
        out.append((word.upper(), rest.strip()))
    return out


def stages() -> list[list[tuple[str, str]]]:
    result: list[list[tuple[str, str]]] = []
    for ins in instructions():
        if ins[0] == "FROM":
            result.append([])
        if result:
            result[-1].append(ins)
    return result


def ignored(path: str) -> bool:
    patterns = [p.strip() for p in (ROOT / ".dockerignore").read_text().splitlines()]
    return any(p and not p.startswith("#") and fnmatch.fnmatch(path.rstrip("/"), p) for p in patterns)


@pytest.mark.unit
def test_multi_stage_non_root_entrypoint_and_healthcheck() -> None:
    build, final = stages()
    assert build[0][1].endswith(" AS build")
    assert final[0][1] == build[0][1].removesuffix(" AS build"), "both stages use the same slim base"
    assert any(word == "ARG" and "slim" in rest for word, rest in instructions())
    assert ("COPY", "--from=build /opt/reaper /opt/reaper") in final
    final_dict = dict(final)
    assert final_dict["USER"].split(":")[0] not in ("root", "0")
    assert json.loads(final_dict["ENTRYPOINT"]) == ["reaper"]
    assert json.loads(final_dict["CMD"]) == ["run"]
    port = HttpSettings().port
    assert final_dict["EXPOSE"] == str(port)
    health = final_dict["HEALTHCHECK"]
    assert "/healthz" in health and f"'{port}'" in health and "REAPER_HTTP__PORT" in health
    assert "REAPER_CONFIG=/etc/reaper/reaper.yaml" in final_dict["ENV"]


@pytest.mark.unit
def test_healthcheck_command_probes_healthz() -> None:
    """The HEALTHCHECK command itself, run against a live endpoint and against nothing."""
    command = json.loads(dict(stages()[-1])["HEALTHCHECK"].split(" CMD ", 1)[1])
    assert command[0] == "python"
    server = HttpServer(CollectorRegistry(), host="127.0.0.1", port=0)
    server.start()
    try:
        env = {**os.environ, "REAPER_HTTP__PORT": str(server.port)}
        ok = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=30, check=False)
        assert ok.returncode == 0, ok.stderr
    finally:
        server.close()
    down = subprocess.run([sys.executable, *command[1:]], env=env, capture_output=True, timeout=30, check=False)
    assert down.returncode != 0


@pytest.mark.unit
def test_copied_sources_exist_and_are_not_ignored() -> None:
    (build, _final) = stages()
    sources = [src for word, rest in build if word == "COPY" for src in rest.split()[:-1]]
    assert sources, "the build stage copies the project"
    for src in sources:
        assert (ROOT / src).exists(), f"COPY source {src} is missing"
        assert not ignored(src), f"COPY source {src} is excluded by .dockerignore"
    # Everything the package needs at run time is copied, and the LICENSE its metadata names (license-files).
    assert {"pyproject.toml", "LICENSE", "leader/", "harvester/"} <= set(sources)


@pytest.mark.integration
def test_build_stage_replayed_in_a_venv(tmp_path: Path) -> None:
    """Run the build stage's COPY and RUN steps with /src and /opt/reaper mapped into tmp_path.

    Dependencies are not downloaded (their wheels are large): pip gets --no-deps through the
    environment, and the final smoke command borrows them from this test's own environment."""
    (build, _final) = stages()
    src, venv = tmp_path / "src", tmp_path / "opt-reaper"
    src.mkdir()
    for word, rest in build:
        if word == "COPY":
            *sources, _dest = rest.split()
            for s in sources:
                target = src / s
                if (ROOT / s).is_dir():
                    shutil.copytree(ROOT / s, target, symlinks=True, ignore=shutil.ignore_patterns("__pycache__"))
                else:
                    shutil.copy2(ROOT / s, target)
    runs = [rest for word, rest in build if word == "RUN"]
    assert len(runs) == 1
    deps = next(p for p in sys.path if p.endswith("site-packages"))
    for command in re.split(r"\s*&&\s*", runs[0]):
        argv = [a.replace("/opt/reaper", str(venv)).replace("/src", str(src)) for a in shlex.split(command)]
        env = {**os.environ, "PIP_NO_DEPS": "1", "PIP_DISABLE_PIP_VERSION_CHECK": "1"}
        if argv[0].endswith("/reaper"):
            env["PYTHONPATH"] = deps  # the dependencies pip was told not to fetch
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=src, timeout=240, check=False)
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    installed = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    # The package, not this checkout, answered: its migrations ship inside it as real files.
    sql_files = sorted(p.name for p in (installed / "harvester" / "postgres" / "sql").glob("*.sql"))
    assert sql_files, "the migrations are installed"
    assert sql_files == sorted(p.name for p in (ROOT / "harvester" / "postgres" / "sql").glob("*.sql"))
    assert not (installed / "harvester" / "postgres" / "sql").is_symlink()
    assert (venv / "bin" / "reaper").exists()
    # The COPY of LICENSE reached the wheel's metadata (pyproject.toml's license-files).
    (license_file,) = installed.glob("outbox_harvester-*.dist-info/licenses/LICENSE")
    assert license_file.read_bytes() == (ROOT / "LICENSE").read_bytes()

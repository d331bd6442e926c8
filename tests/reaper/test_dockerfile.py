"""The Dockerfile, checked without a Docker engine: its structure, its labels, and its build stage replayed in
a venv (with the otel extra), whose ``reaper --help`` links to files of the repository."""

from __future__ import annotations

import fnmatch
import json
import os
import re
import shlex
import shutil
import subprocess
import sys
import tomllib
from importlib.metadata import requires
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name
from prometheus_client import CollectorRegistry

from harvester import __version__
from harvester.daemon.http import HttpServer
from harvester.daemon.settings import HttpSettings
from tests.reaper.test_packaging import PROJECT, linked_file, urls
from tests.support.paths import ROOT

DOCKERFILE = ROOT / "Dockerfile"
LOCK = ROOT / "requirements.lock"  # the runtime dependencies
BUILD_LOCK = ROOT / "requirements-build.lock"  # the build backend
OTEL_LOCK = ROOT / "requirements-otel.lock"  # the otel extra, with --build-arg OTEL=1
DEV_LOCK = ROOT / "requirements-dev.lock"  # ./dev.sh setup's constraints


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
    """As Docker reads .dockerignore: a pattern excludes what it matches and what is under it, a ``!``
    pattern takes it back in, the last matching line decides."""
    path = path.rstrip("/")
    out = False
    for line in (ROOT / ".dockerignore").read_text().splitlines():
        pattern = line.strip()
        if not pattern or pattern.startswith("#"):
            continue
        keep = pattern.startswith("!")
        pattern = pattern.removeprefix("!")
        if fnmatch.fnmatch(path, pattern) or path.startswith(pattern + "/"):
            out = not keep
    return out


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
    needed = {"pyproject.toml", "setup.py", "LICENSE", "leader/", "harvester/", "sql/", LOCK.name, BUILD_LOCK.name}
    needed.add(OTEL_LOCK.name)
    assert needed <= set(sources)


def pins(lock: Path) -> dict[str, tuple[str, list[str]]]:
    """{canonical name: (version, hashes)} of a pip-compile lock file."""
    out: dict[str, tuple[str, list[str]]] = {}
    for entry in re.split(r"\n(?=\S)", lock.read_text()):
        line = entry.split("#", 1)[0].replace("\\\n", " ").strip()
        if not line:
            continue
        requirement, *options = line.split()
        name, sep, version = requirement.partition("==")
        assert sep and "[" not in name, f"{lock.name}: {requirement} is not pinned to one version"
        hashes = [o.removeprefix("--hash=sha256:") for o in options if o.startswith("--hash=sha256:")]
        assert hashes and len(hashes) == len(options), f"{lock.name}: {requirement} has no sha256 hash"
        out[canonicalize_name(name)] = (version, hashes)
    return out


@pytest.mark.unit
def test_locks_pin_every_dependency_with_hashes() -> None:
    """The locks cover pyproject.toml: a dependency added there without regenerating the lock fails here."""
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())
    for lock, requirements in (
        (LOCK, project["project"]["dependencies"]),
        (BUILD_LOCK, project["build-system"]["requires"]),
    ):
        pinned = pins(lock)
        for text in requirements:
            requirement = Requirement(text)
            name = canonicalize_name(requirement.name)
            assert name in pinned, f"{name} is not in {lock.name}: regenerate it (the command is in its header)"
            assert requirement.specifier.contains(pinned[name][0]), f"{lock.name} pins {name} outside {text}"
        # Each lock says how to regenerate it, and docs/reaper.md shows the same command.
        (command,) = re.findall(r"^#    (pip-compile .*)$", lock.read_text(), re.MULTILINE)
        assert command in (ROOT / "docs" / "reaper.md").read_text(), command
    assert "setuptools" not in pins(LOCK) and "pip" not in pins(LOCK)


def build_commands(run: str) -> list[tuple[str | None, str]]:
    """The ``&&``-joined commands of a RUN, each with the build argument it depends on: ``if [ "$ARG" = 1 ];
    then COMMAND; fi`` gives ("ARG", COMMAND), any other command (None, command)."""
    out: list[tuple[str | None, str]] = []
    for command in re.split(r"\s*&&\s*", run):
        conditional = re.fullmatch(r'if \[ "\$(\w+)" = 1 \]; then (.*); fi', command)
        out.append((conditional.group(1), conditional.group(2)) if conditional else (None, command))
    return out


@pytest.mark.unit
def test_labels_name_the_version_license_and_homes_of_pyproject() -> None:
    (_build, final) = stages()
    (label,) = [rest for word, rest in final if word == "LABEL"]
    labels = dict(item.split("=", 1) for item in shlex.split(label))
    urls_ = PROJECT["urls"]
    assert labels == {
        "org.opencontainers.image.title": "outbox-harvester reaper",
        "org.opencontainers.image.description": labels["org.opencontainers.image.description"],
        "org.opencontainers.image.version": __version__,
        "org.opencontainers.image.revision": "${REVISION}",
        "org.opencontainers.image.licenses": PROJECT["license"],
        "org.opencontainers.image.url": urls_["Homepage"],
        "org.opencontainers.image.source": urls_["Repository"],
        "org.opencontainers.image.documentation": urls_["Documentation"],
    }
    assert ("ARG", "REVISION") in final


@pytest.mark.unit
def test_otel_and_dev_locks_cover_their_extras() -> None:
    """requirements-otel.lock pins the otel extra with hashes (installed --no-deps, so what it needs is in
    requirements.lock); requirements-dev.lock, ./dev.sh setup's constraints, pins every extra and dev tool
    within pyproject.toml's bounds; ./dev.sh lock writes both, and setup installs with the constraints."""
    extras = PROJECT["optional-dependencies"]
    otel, runtime = pins(OTEL_LOCK), pins(LOCK)
    for text in extras["otel"]:
        requirement = Requirement(text)
        name = canonicalize_name(requirement.name)
        assert name in otel and requirement.specifier.contains(otel[name][0]), f"{OTEL_LOCK.name}: {text}"
        for dependency in requires(requirement.name) or []:
            needed = Requirement(dependency)
            if needed.marker is None or needed.marker.evaluate():
                assert canonicalize_name(needed.name) in runtime, f"{name} needs {needed.name}: not in {LOCK.name}"
    constraints = {}
    for line in DEV_LOCK.read_text().splitlines():
        if line and not line.startswith("#"):
            pinned, sep, version = line.partition("==")
            assert sep, f"{DEV_LOCK.name}: {line} is not a pin"
            constraints[canonicalize_name(pinned)] = version
    for extra, requirements in extras.items():
        for text in requirements:
            requirement = Requirement(text)
            name = canonicalize_name(requirement.name)
            if name == "outbox-harvester":
                continue
            assert name in constraints, f"{DEV_LOCK.name} lacks {name} ({extra}): ./dev.sh lock"
            assert requirement.specifier.contains(constraints[name]), f"{DEV_LOCK.name} pins {name} outside {text}"
    dev_sh = (ROOT / "dev.sh").read_text()
    assert '-e ".[dev]" -c requirements-dev.lock' in dev_sh
    assert all(f">{lock.name}" in dev_sh for lock in (DEV_LOCK, OTEL_LOCK))


@pytest.mark.unit
def test_build_installs_only_from_the_hashed_locks() -> None:
    """Every pip install of the build stage is hash-checked against a lock, or takes only the wheel just built;
    the build backend is the locked one; the runtime virtualenv gets no pip and no setuptools."""
    (build, final) = stages()
    (run,) = [rest for word, rest in build if word == "RUN"]
    commands = [command for _arg, command in build_commands(run)]
    assert [arg for arg, _command in build_commands(run) if arg] == ["OTEL"]
    assert ("ARG", "OTEL") in build
    installs = [shlex.split(c) for c in commands if re.search(r"\bpip\b.* install ", c)]
    locks = set()
    for argv in installs:
        if "--require-hashes" in argv:
            locks.add(argv[argv.index("-r") + 1])
        else:
            assert {"--no-deps", "--no-index"} <= set(argv), f"{shlex.join(argv)} resolves outside the locks"
    assert locks == {LOCK.name, BUILD_LOCK.name, OTEL_LOCK.name}
    (wheel,) = [shlex.split(c) for c in commands if " wheel " in c]
    assert {"--no-deps", "--no-build-isolation"} <= set(wheel), "the wheel is built by the locked setuptools"
    (venv,) = [c for c in commands if "venv" in c and "/opt/reaper" in c]
    assert "--without-pip" in venv
    # The base image's own pip and setuptools go too.
    (cleanup, *_rest) = re.split(r"\s*&&\s*", dict(final)["RUN"])
    assert re.fullmatch(r"python -m pip uninstall --yes pip setuptools( wheel)?", cleanup)


@pytest.mark.unit
def test_base_image_is_pinned_by_digest_or_takes_the_documented_digest_arg() -> None:
    froms = [rest.removesuffix(" AS build") for word, rest in instructions() if word == "FROM"]
    assert len(froms) == 2 and froms[0] == froms[1]
    if re.search(r"@sha256:[0-9a-f]{64}$", froms[0]):
        return
    assert froms[0] == "${PYTHON_IMAGE}${PYTHON_DIGEST:+@}${PYTHON_DIGEST}"
    args = [rest.split("=")[0] for word, rest in instructions() if word == "ARG"]
    assert {"PYTHON_IMAGE", "PYTHON_DIGEST"} <= set(args)
    assert "--build-arg PYTHON_DIGEST=" in (ROOT / "docs" / "reaper.md").read_text()


@pytest.mark.integration
def test_build_stage_replayed_in_a_venv(tmp_path: Path) -> None:
    """Run the build stage's COPY and RUN steps, with OTEL=1, with /src, /opt/build, /opt/reaper and /wheels
    mapped into tmp_path: pip really installs the locks (hash-checked; pip's cache keeps repeated runs cheap).
    The installed ``reaper --help`` links to files of the repository, and so does the package's metadata."""
    (build, _final) = stages()
    src, venv = tmp_path / "src", tmp_path / "opt-reaper"
    paths = {"/opt/build": tmp_path / "opt-build", "/opt/reaper": venv, "/wheels": tmp_path / "wheels", "/src": src}
    src.mkdir()
    for word, rest in build:
        if word == "COPY":
            *sources, _dest = rest.split()
            for s in sources:
                target = src / s
                if (ROOT / s).is_dir():
                    skip = shutil.ignore_patterns("__pycache__", "*.so")  # as .dockerignore
                    shutil.copytree(ROOT / s, target, symlinks=True, ignore=skip)
                else:
                    shutil.copy2(ROOT / s, target)
    runs = [rest for word, rest in build if word == "RUN"]
    assert len(runs) == 1
    env = {k: v for k, v in os.environ.items() if k not in ("PYTHONPATH", "PYTHONHOME")}  # not this checkout
    env["HARVESTER_NATIVE_CACHE"] = str(ROOT / ".local" / "native")  # librdkafka's headers, fetched once
    for _arg, command in build_commands(runs[0]):  # OTEL=1: every conditional command runs
        if command.startswith("apt-get "):
            continue  # the image's compiler and librdkafka headers: this machine's (deploy/native/build.sh)
        argv = shlex.split(command)
        for container_path, local in paths.items():
            argv = [a.replace(container_path, str(local)) for a in argv]
        argv[0] = sys.executable if argv[0] == "python" else argv[0]
        done = subprocess.run(argv, capture_output=True, text=True, env=env, cwd=src, timeout=280, check=False)
        assert done.returncode == 0, f"{command}: {done.stderr[-2000:]}"
    assert done.stdout.strip().endswith(__version__), "the last step runs the installed reaper"
    installed = venv / "lib" / f"python{sys.version_info.major}.{sys.version_info.minor}" / "site-packages"
    # The runtime virtualenv holds exactly the lock's pins and the package: no pip, no setuptools.
    distributions = {}
    for info in installed.glob("*.dist-info"):
        name, version = info.name.removesuffix(".dist-info").split("-")
        distributions[canonicalize_name(name)] = version
    expected = {name: version for lock in (LOCK, OTEL_LOCK) for name, (version, _hashes) in pins(lock).items()}
    assert distributions == {**expected, "outbox-harvester": __version__}
    assert not (installed / "pip").exists() and not (installed / "setuptools").exists()
    # The package, not this checkout, answered: its migrations ship inside it as real files.
    sql_files = sorted(p.name for p in (installed / "harvester" / "postgres" / "sql").glob("*.sql"))
    assert sql_files, "the migrations are installed"
    assert sql_files == sorted(p.name for p in (ROOT / "sql").glob("*.sql"))
    assert not (installed / "harvester" / "postgres" / "sql").is_symlink()
    assert (venv / "bin" / "reaper").exists()
    # The native modules were built into the installed package: the insert decoder, and the producer
    # process's loop against the installed confluent-kafka's librdkafka.
    modules = "import confluent_kafka, harvester.kafka._rdkafka_loop, harvester.postgres.log._usual_insert"
    native = [str(venv / "bin" / "python"), "-P", "-c", modules]
    loaded = subprocess.run(native, capture_output=True, text=True, env=env, cwd=tmp_path, timeout=60, check=False)
    assert loaded.returncode == 0, loaded.stderr
    # The COPY of LICENSE reached the wheel's metadata (pyproject.toml's license-files).
    (license_file,) = installed.glob("outbox_harvester-*.dist-info/licenses/LICENSE")
    assert license_file.read_bytes() == (ROOT / "LICENSE").read_bytes()
    # The wheel carries no docs/: what its help and metadata link to are files of the repository.
    reaper = [str(venv / "bin" / "reaper"), "--help"]
    helped = subprocess.run(reaper, capture_output=True, text=True, env=env, cwd=tmp_path, check=True, timeout=60)
    assert {linked_file(u).name for u in urls(helped.stdout)} >= {"reaper.md", "security.md", "writers.md"}
    (metadata,) = installed.glob("outbox_harvester-*.dist-info/METADATA")
    project_urls = re.findall(r"^Project-URL: [^,]+, (.+)$", metadata.read_text(), re.MULTILINE)
    assert sorted(project_urls) == sorted(PROJECT["urls"].values())
    for url in project_urls:
        linked_file(url)
    # The otel extra works in the image: the publish span's module imports.
    otel = [str(venv / "bin" / "python"), "-c", "import harvester.otel"]
    subprocess.run(otel, capture_output=True, env=env, cwd=tmp_path, check=True, timeout=60)

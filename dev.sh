#!/usr/bin/env bash
# Developer entry point.
#   ./dev.sh demo    set up everything and run the harvester on local defaults (the main job)
#   ./dev.sh test    set up everything and run lint, type checks and the whole test suite
#   ./dev.sh setup   create .venv and install the project with its dev extras; start services
#   ./dev.sh bench NAME   run bench/NAME.py (see bench/README.md)
#   ./dev.sh lock    pin what .venv holds now: requirements-dev.lock, requirements-otel.lock
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$PWD
VENV=${HARVESTER_VENV:-$ROOT/.venv}
PY=$VENV/bin/python

setup_venv() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  # Re-install only when the project's metadata or the pinned versions changed since the last install.
  local stamp=$VENV/.outbox-harvester-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ] || [ requirements-dev.lock -nt "$stamp" ]; then
    echo "installing the project and its dev extras into $VENV (log: .local/pip.log) ..."
    mkdir -p .local
    # The constraints hold every extra and dev tool at the versions the suite last passed with, so a
    # setup today and one in a month install the same (a dependency new in pyproject.toml resolves freely
    # until the next ./dev.sh lock).
    { "$PY" -m pip install --disable-pip-version-check -U pip &&
      "$PY" -m pip install --disable-pip-version-check -e ".[dev]" -c requirements-dev.lock; } >.local/pip.log 2>&1 ||
      { tail -n 30 .local/pip.log >&2; echo "pip install failed (see .local/pip.log)" >&2; exit 1; }
    touch "$stamp"
  fi
  build_native
}

# The native modules (deploy/native/build.sh: the log source's insert decoder, the producer process's
# loop), built again when a C source, the build script or the installed packages changed. Without them
# the harvester runs their pure-Python twins, slower: say so, and go on.
build_native() {
  local suffix built stale=
  suffix=$("$PY" -c 'import sysconfig; print(sysconfig.get_config_var("EXT_SUFFIX"))')
  for built in harvester/postgres/log/_usual_insert"$suffix" harvester/kafka/_rdkafka_loop"$suffix"; do
    if [ ! -f "$built" ] || [ -n "$(find harvester -name '_*.[ch]' -newer "$built" 2>/dev/null)" ] ||
      [ deploy/native/build.sh -nt "$built" ] || [ "$VENV/.outbox-harvester-installed" -nt "$built" ]; then
      stale=1
    fi
  done
  if [ -n "$stale" ]; then
    mkdir -p .local
    bash deploy/native/build.sh "$PY" >.local/native.log 2>&1 ||
      { tail -n 5 .local/native.log >&2
        echo "the native modules were not all built (.local/native.log): what is missing runs in Python" >&2; }
  fi
}

services() { bash deploy/local/services.sh start; }

# Pin the versions .venv holds (run it once the suite passes with them): requirements-dev.lock, pip's
# constraints for setup_venv (pip freeze: every dev tool and extra, and what they pull in; pip itself
# is left out, setup upgrades it); requirements-otel.lock, the otel extra's packages with their hashes,
# for the image's --build-arg OTEL=1 (their own dependencies must be in requirements.lock; a test checks).
lock() {
  { echo "# Constraints for ./dev.sh setup: the versions .venv held when the suite last passed."
    echo "# Python $("$PY" -c 'import platform; print(platform.python_version())'). Refresh: ./dev.sh lock"
    "$PY" -m pip freeze --all --exclude-editable | grep -v '^pip=='; } >requirements-dev.lock
  local pins tmp
  pins=$("$PY" - <<'PY'
import tomllib
from importlib.metadata import version
from packaging.requirements import Requirement
for text in tomllib.load(open("pyproject.toml", "rb"))["project"]["optional-dependencies"]["otel"]:
    name = Requirement(text).name
    print(f"{name}=={version(name)}")
PY
)
  tmp=$(mktemp -d)
  # shellcheck disable=SC2086  # one argument per pin
  "$PY" -m pip download -q --disable-pip-version-check --no-deps -d "$tmp" $pins
  { echo "# The otel extra for the image (Dockerfile, --build-arg OTEL=1), at .venv's versions, hashed."
    echo "# Refresh: ./dev.sh lock"
    for pin in $pins; do
      echo "$pin \\"
      "$PY" -m pip hash "$tmp/$(echo "${pin%%==*}" | tr - _)"-* | grep -- --hash= | sed 's/^/    /'
    done; } >requirements-otel.lock
  rm -rf "$tmp"
  echo "wrote requirements-dev.lock ($(grep -c '==' requirements-dev.lock) pins) and requirements-otel.lock"
}

case "${1:-}" in
  setup)
    setup_venv; services ;;
  demo)
    setup_venv; services
    shift; exec "$PY" -m examples.demo "$@" ;;
  test)
    setup_venv; services
    shift
    echo "== ruff"; "$VENV/bin/ruff" check harvester leader tests bench examples
    "$VENV/bin/ruff" format --check harvester leader tests bench examples
    echo "== mypy --strict"; "$VENV/bin/mypy"
    echo "== pytest"
    # Two workers: most of the suite's time is spent waiting on services (fault windows, failovers);
    # tests that share a fixed resource stay in one worker (see tests/conftest.py).
    set +e; "$PY" -m pytest -n "${TEST_WORKERS:-2}" "$@"; rc=$?; set -e
    # Exit 5 means pytest collected nothing: this suite always has tests, so that is a failure.
    if [ $rc -eq 5 ]; then echo "pytest collected no tests" >&2; exit 1; fi
    exit $rc ;;
  lock)
    lock ;;
  bench)
    setup_venv; services
    name=${2:?usage: ./dev.sh bench NAME}; shift 2
    exec "$PY" "bench/$name.py" "$@" ;;
  *)
    sed -n '2,7p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

#!/usr/bin/env bash
# Developer entry point.
#   ./dev.sh demo    set up everything and run the harvester on local defaults (the main job)
#   ./dev.sh test    set up everything and run lint, type checks and the whole test suite
#   ./dev.sh setup   create .venv and install the project with its dev extras; start services
#   ./dev.sh bench NAME   run bench/NAME.py (see bench/README.md)
set -euo pipefail
cd "$(dirname "${BASH_SOURCE[0]}")"
ROOT=$PWD
VENV=${HARVESTER_VENV:-$ROOT/.venv}
PY=$VENV/bin/python

setup_venv() {
  if [ ! -x "$PY" ]; then
    python3 -m venv "$VENV"
  fi
  # Re-install only when the project's metadata changed since the last install.
  local stamp=$VENV/.outbox-harvester-installed
  if [ ! -f "$stamp" ] || [ pyproject.toml -nt "$stamp" ]; then
    echo "installing the project and its dev extras into $VENV (log: .local/pip.log) ..."
    mkdir -p .local
    { "$PY" -m pip install --disable-pip-version-check -U pip &&
      "$PY" -m pip install --disable-pip-version-check -e ".[dev]"; } >.local/pip.log 2>&1 ||
      { tail -n 30 .local/pip.log >&2; echo "pip install failed (see .local/pip.log)" >&2; exit 1; }
    touch "$stamp"
  fi
}

services() { bash deploy/local/services.sh start; }

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
  bench)
    setup_venv; services
    name=${2:?usage: ./dev.sh bench NAME}; shift 2
    exec "$PY" "bench/$name.py" "$@" ;;
  *)
    sed -n '2,6p' "$0" | sed 's/^# \{0,1\}//'; exit 2 ;;
esac

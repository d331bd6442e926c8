"""The ``reaper`` command, run from this checkout in a process of its own."""

from __future__ import annotations

import os
import subprocess
import sys

from tests.support.paths import ROOT

REAPER = [sys.executable, "-m", "harvester.daemon.cli"]
"""The ``reaper`` command, run from this checkout."""


def reaper_environment(**extra: str) -> dict[str, str]:
    """This process's environment without ``REAPER_*`` settings or libpq's password sources, so that
    only the test's own file (and ``extra``) configures the reaper."""
    unset = ("PGPASSWORD", "PGPASSFILE")
    kept = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_") and k not in unset}
    return {**kept, **extra}


def run_reaper(*args: str, env: dict[str, str] | None = None, timeout: float = 90) -> subprocess.CompletedProcess[str]:
    """``reaper ARGS`` to completion, output captured, no standard input."""
    return subprocess.run(
        [*REAPER, *args],
        capture_output=True,
        text=True,
        stdin=subprocess.DEVNULL,
        timeout=timeout,
        check=False,
        env=env if env is not None else reaper_environment(),
        cwd=ROOT,
    )

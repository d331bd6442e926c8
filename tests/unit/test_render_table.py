"""bench/render_table.py on a small run shaped as bench/peers.py writes it: the Markdown rows in the
README's order with their ratios, shares of the ceilings and CPU, the caption with the run's date and
machine, the README's block replaced between its markers, and a clear one-line error for a file it
cannot read."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

SCRIPT = ROOT / "bench" / "render_table.py"
RUN = ROOT / "tests" / "unit" / "fixtures" / "peers-run.json"


def render(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([sys.executable, str(SCRIPT), *args], capture_output=True, text=True, check=False)


def test_renders_the_rows_in_order_and_the_caption() -> None:
    done = render(str(RUN))
    assert done.returncode == 0, done.stderr
    rows = [line for line in done.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert rows[1:] == [
        "| Debezium + EventRouter | 40,000 | 1.00x (1.00-1.00) | 0.41 / - / 0.60 | 0.040 | 0.002 | 0.010"
        " | 20.0 / 40.0 |",
        "| harvester, log source | 60,000 | 1.50x (1.50-1.50) | 0.61 / 0.40 / 0.90 | 0.012 | 0.004 | 0.010"
        " | 5.2 / 9.0 |",
        "| harvester, table-less outbox | 80,000 | 2.00x (2.00-2.00) | - | 0.010 | 0.003 | 0.010 | - |",
    ]
    caption = "Burst of 200,000 records into an idle outbox, then a steady 2,000 records/s; medians of 1 round."
    assert caption in done.stdout
    assert "Measured 2026-11-28 on 2 cores (Linux-6.1-x86_64), load average 0.4 to 1.2" in done.stdout
    assert "Debezium 3.3.2.Final in Kafka Connect 4.1.1" in done.stdout


def test_rewrites_only_the_block_between_the_markers(tmp_path: Path) -> None:
    readme = tmp_path / "README.md"
    readme.write_text("before\n<!-- peers-table -->\nold table\n<!-- /peers-table -->\nafter\n")
    done = render(str(RUN), "--readme", str(readme))
    assert done.returncode == 0, done.stderr
    text = readme.read_text()
    assert text.startswith("before\n<!-- peers-table -->\nBurst of 200,000")
    assert text.endswith("`./dev.sh bench peers --rounds 1 --json peers.json`.\n<!-- /peers-table -->\nafter\n")
    assert "old table" not in text


def test_an_unreadable_run_is_one_line_and_a_nonzero_exit(tmp_path: Path) -> None:
    stale = tmp_path / "old.json"
    stale.write_text('{"version": 0}')
    done = render(str(stale))
    assert done.returncode == 2
    assert done.stderr.count("\n") == 1 and "version" in done.stderr

"""The README's comparison table, rendered from the JSON of `./dev.sh bench peers --json` runs, so
that the table cannot drift from a run.

    python bench/render_table.py peers-200k.json [peers-1m.json ...]            # prints the Markdown
    python bench/render_table.py peers-200k.json peers-1m.json --readme README.md  # rewrites it in place

One table per run (a run has one burst size), each captioned with the run's date, machine, load,
versions and command. ``--readme`` replaces what lies between the ``<!-- peers-table -->`` and
``<!-- /peers-table -->`` lines of the file. The fields read are those bench/peers.py's docstring
lists; the standard library only.
"""

from __future__ import annotations

import argparse
import json
import re
import sys
from pathlib import Path
from typing import Any

BEGIN, END = "<!-- peers-table -->", "<!-- /peers-table -->"
# The relays the README compares, in its order: the default-limits row of each source.
ROWS = ("debezium", "mark-purge", "log", "log-retention", "tableless")
# The README's words for each source (the bench's labels name its limits, not the source).
SOURCES = {
    "debezium": "Debezium + EventRouter",
    "mark_purge": "harvester, mark-purge/reset",
    "log": "harvester, log source",
    "retain": "harvester, log source, retention window",
    "messages": "harvester, table-less outbox",
}


def _num(value: float | None, digits: int) -> str:
    return "-" if value is None else f"{value:,.{digits}f}"


def _shares(shares: dict[str, dict[str, float] | None]) -> str:
    """The medians of a relay's shares of the ceilings measured in its run ("-" for one not measured)."""
    if not any(shares.values()):
        return "-"
    return " / ".join(_num((shares.get(kind) or {}).get("median"), 2) for kind in ("decode", "produce", "delete"))


def label(relay: dict[str, Any]) -> str:
    name = SOURCES.get(relay["source"], relay["label"])
    return f"{name}, tuned" if relay["tuned"] else name


def render(run: dict[str, Any]) -> str:
    """One run as a Markdown table with its caption."""
    if run.get("version") != 1:
        raise ValueError(f"unknown bench JSON version {run.get('version')!r} (this renderer reads version 1)")
    workload, machine, versions = run["workload"], run["machine"], run["versions"]
    summary, steady, relays = run["summary"], run.get("steady", {}), run["relays"]
    then = f", then a steady {workload['steady_rate']:,.0f} records/s" if steady else ""
    rounds = f"{workload['rounds']} round{'s' if workload['rounds'] != 1 else ''}"
    lines = [
        f"Burst of {workload['records']:,} records into an idle outbox{then}; medians of {rounds}."
        " CPU is seconds per 1,000 records.",
        "",
        "| relay | records/s | vs Debezium (range) | share of the ceilings: decode / produce / delete"
        " | CPU: relay | PostgreSQL | broker | steady p50 / p99 ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: |",
    ]
    for name in [n for n in ROWS if n in summary] + [n for n in summary if n not in ROWS]:
        row, ratio = summary[name], summary[name]["vs_debezium"]
        latency = steady.get(name)
        steady_ms = "-" if latency is None else f"{latency['p50_ms']:.1f} / {latency['p99_ms']:.1f}"
        lines.append(
            f"| {label(relays[name])} | {_num(row['rate'], 0)}"
            f" | {ratio['median']:.2f}x ({ratio['min']:.2f}-{ratio['max']:.2f}) | {_shares(row.get('shares', {}))}"
            f" | {_num(row['cpu_relay'], 3)} | {_num(row['cpu_postgres'], 3)} | {_num(row['cpu_broker'], 3)}"
            f" | {steady_ms} |"
        )
    load = f"{machine['load_start'][0]:.1f} to {machine['load_end'][0]:.1f}"
    lines += [
        "",
        f"Measured {run['date'][:10]} on {machine['cpus']} cores ({machine['platform']}), load average {load};"
        f" PostgreSQL {versions['postgresql']}, Debezium {versions['debezium']} in Kafka Connect"
        f" {versions['kafka_connect']}; {workload['compression']} compression. Command: `{run['command']}`.",
    ]
    return "\n".join(lines) + "\n"


def replace_between_markers(text: str, tables: str) -> str:
    pattern = re.compile(rf"^{re.escape(BEGIN)}\n.*?^{re.escape(END)}$", re.DOTALL | re.MULTILINE)
    if len(pattern.findall(text)) != 1:
        raise ValueError(f"expected one {BEGIN} ... {END} block")
    return pattern.sub(lambda _: f"{BEGIN}\n{tables}{END}", text)


def main(argv: list[str] | None = None) -> int:
    p = argparse.ArgumentParser(description="Render bench/peers.py's JSON as the README's comparison table.")
    p.add_argument("runs", nargs="+", type=Path, help="JSON files written by ./dev.sh bench peers --json")
    p.add_argument("--readme", type=Path, help="rewrite the table between the markers of this file instead of printing")
    args = p.parse_args(argv)
    try:
        tables = "\n".join(render(json.loads(path.read_text())) for path in args.runs)
        if args.readme is None:
            sys.stdout.write(tables)
        else:
            args.readme.write_text(replace_between_markers(args.readme.read_text(), tables))
    except (OSError, ValueError, KeyError) as exc:
        print(f"render_table: {exc!r}", file=sys.stderr)
        return 2
    return 0


if __name__ == "__main__":
    sys.exit(main())

"""Leader failover times of Fast NELI with real OS processes: SIGKILL, SIGSTOP and SIGTERM of the leader.

    ./dev.sh bench failover [--runs 5] [--members 3] [--scenarios kill,stop,term] [timing flags]

Each run starts ``--members`` competing ``python -m examples.leader_demo`` processes in a fresh group,
waits for one stable leader, signals it and measures the time from the signal to the successor's LeaderAcquired.

- kill: SIGKILL; the coordinator notices after about ``--session-timeout``.
- stop: SIGSTOP for ``--session-timeout`` + 2 s (a zombie), then SIGCONT; the resumed process must fence
  itself and do no more leader work (counted as "zombie work" and expected to be 0).
- term: SIGTERM; the elector closes gracefully and leaves the group at once.

Also printed per scenario: the longest time two members both believed they led ("overlap").
Timing flags default to the test settings (``examples.leader_demo.DemoSettings``); see ``docs/leader.md``.
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import sys
import time
import uuid
from dataclasses import asdict, dataclass, field
from pathlib import Path

from confluent_kafka.admin import AdminClient

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from examples.leader_demo import Competitor, DemoSettings, max_overlap, wait_new_leader, wait_single_leader

BOOTSTRAP = os.environ.get("HARVESTER_TEST_KAFKA", "127.0.0.1:9092")
SIGNALS = {"kill": signal.SIGKILL, "stop": signal.SIGSTOP, "term": signal.SIGTERM}


@dataclass
class Outcome:
    """Measurements of one scenario over all its runs."""

    failover: list[float] = field(default_factory=list)
    overlap: list[float] = field(default_factory=list)
    zombie_work: int = 0
    failures: list[str] = field(default_factory=list)


def run_once(scenario: str, members: int, settings: DemoSettings, topics: list[str], outcome: Outcome) -> None:
    group_id = f"bench_neli_{uuid.uuid4().hex[:10]}"
    topics.append(f"{group_id}.neli")
    group = [Competitor(BOOTSTRAP, group_id, settings) for _ in range(members)]
    try:
        old = wait_single_leader(group, 60.0)
        sent = old.signal(SIGNALS[scenario])
        _, acquired_at = wait_new_leader(group, sent, settings.session_timeout + 30.0, exclude=old)
        outcome.failover.append(acquired_at - sent)
        if scenario == "stop":
            time.sleep(max(0.0, sent + settings.session_timeout + 2.0 - time.monotonic()))
            resumed = old.signal(signal.SIGCONT)
            time.sleep(settings.heartbeat_timeout + 1.0)
            outcome.zombie_work += len(old.lines("work", resumed)) + len(old.lines("acquired", resumed))
        outcome.overlap.append(max_overlap(group, time.monotonic()))
    except TimeoutError as e:
        outcome.failures.append(str(e).splitlines()[0])
    finally:
        for c in group:
            c.stop()


def summary(values: list[float]) -> str:
    if not values:
        return "no data"
    return f"min {min(values):6.3f}  median {statistics.median(values):6.3f}  max {max(values):6.3f} s"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--runs", type=int, default=5, help="runs per scenario")
    parser.add_argument("--members", type=int, default=3, help="competing processes per run")
    parser.add_argument("--scenarios", default="kill,stop,term", help="comma-separated: kill, stop, term")
    for key, value in asdict(DemoSettings()).items():
        parser.add_argument(f"--{key.replace('_', '-')}", type=float, default=value)
    ns = parser.parse_args()
    scenarios = [s.strip() for s in ns.scenarios.split(",") if s.strip()]
    unknown = set(scenarios) - SIGNALS.keys()
    if unknown:
        parser.error(f"unknown scenarios {sorted(unknown)}")
    settings = DemoSettings(**{key: getattr(ns, key) for key in asdict(DemoSettings())})
    print(f"bootstrap {BOOTSTRAP}, {ns.members} members, {ns.runs} runs per scenario")
    print("config: " + ", ".join(f"{k}={v:g}s" for k, v in asdict(settings).items()))
    topics: list[str] = []
    results: dict[str, Outcome] = {}
    try:
        for scenario in scenarios:
            outcome = results[scenario] = Outcome()
            for i in range(ns.runs):
                run_once(scenario, ns.members, settings, topics, outcome)
                latest = f"{outcome.failover[-1]:.3f} s" if len(outcome.failover) > i else "FAILED"
                print(f"  {scenario} run {i + 1}/{ns.runs}: {latest}", flush=True)
    finally:
        admin = AdminClient({"bootstrap.servers": BOOTSTRAP})
        for future in admin.delete_topics(topics, operation_timeout=30).values() if topics else ():
            future.result(30)
    print()
    for scenario, outcome in results.items():
        print(f"SIG{scenario.upper():5} failover  {summary(outcome.failover)}   (n={len(outcome.failover)})")
        print(f"{'':9} overlap   {summary(outcome.overlap)}")
        if scenario == "stop":
            print(f"{'':9} zombie work or re-acquisition after SIGCONT: {outcome.zombie_work}")
        for failure in outcome.failures:
            print(f"{'':9} FAILED: {failure}")


if __name__ == "__main__":
    main()

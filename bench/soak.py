"""Chaos soak: the chaos test of ``tests/chaos`` run for longer, with a summary table.

    python bench/soak.py --minutes 30 [--seed S] [--delivery at_least_once] [--rate 250]

Three harvester processes drain an outbox that writer threads fill continuously while a fault
injector SIGKILLs and SIGSTOPs the leader, restarts Kafka and PostgreSQL and terminates the
harvesters' connections (private services on ports 15432 and 29092; the shared ones are never
touched). Prints the faults as they happen, then the summary table; exits 1 on any violation,
after printing the seed, the fault sequence and the evidence. See docs/chaos.md.
"""

from __future__ import annotations

import argparse
import random
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from tests.chaos.harness import ChaosSettings, delivery_modes, run_chaos


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--minutes", type=float, default=10.0, help="length of the fault window")
    parser.add_argument("--seed", type=int, default=None, help="replay a run (default: random, printed)")
    parser.add_argument("--delivery", choices=delivery_modes(), default="at_least_once")
    parser.add_argument("--rate", type=float, default=250.0, help="records per second over all writers")
    parser.add_argument("--keys", type=int, default=3000, help="normal keys (plus --hot-keys hot ones)")
    parser.add_argument("--hot-keys", type=int, default=4)
    parser.add_argument("--writers", type=int, default=4)
    ns = parser.parse_args()
    seed = ns.seed if ns.seed is not None else random.SystemRandom().randrange(1 << 31)
    settings = ChaosSettings(
        seed=seed,
        fault_seconds=ns.minutes * 60,
        delivery=ns.delivery,
        records_per_second=ns.rate,
        keys=ns.keys,
        hot_keys=ns.hot_keys,
        writers=ns.writers,
    )
    print(f"soak: seed {seed} (replay: --seed {seed}), {ns.minutes:g} min of faults", flush=True)
    report = run_chaos(settings, log=lambda line: print(line, flush=True))
    print()
    print(report.table())
    if report.violations():
        print()
        print(report.failure_text())
        sys.exit(1)


if __name__ == "__main__":
    main()

"""A burst into an idle outbox, drained by the relay users would pick instead (Debezium's PostgreSQL
connector with its outbox EventRouter in Kafka Connect standalone) and by this project's harvester.

    ./dev.sh bench peers [--records 200000] [--large] [--rounds 2] [--keys 1000] [--rate 2000] [--seconds 20]
        [--relays debezium,mark-purge,mark-purge-tuned,log,log-tuned,log-retention,tableless,tableless-tuned]
        [--compression lz4] [--spread 0] [--ceilings decode,produce,delete] [--json peers.json]

``--large`` uses 1,000,000 records. Needs Java 17: Kafka Connect 4.1.1 (the local broker's
version) and Debezium 3.3.2.Final (io.debezium:debezium-connector-postgres, whose jars include the
io.debezium.transforms.outbox.EventRouter SMT) are resolved from Maven Central into
``~/.cache/outbox-harvester/`` on first use. The bench starts a private PostgreSQL with
``wal_level=logical`` (``deploy/local/services.sh start-postgres`` in a temporary directory, on a free
loopback port) and one Connect standalone worker (REST on a free loopback port), uses the local Kafka
for both relays, and stops everything it started on exit.

Each round COPies N records (100-byte values, ``--keys`` keys) in one transaction into an idle
outbox (goharvest's layout); ``--spread S`` makes that transaction pause S seconds in all, in 20
pauses between COPYs of its parts, a writer the walsender can keep up with, so that it streams the
transaction while it is written (the harvester asks for that; Debezium's connector does not). The
bench times, from that commit:
  - Debezium: until all N records are on the routed topic (sum of its end offsets; the EventRouter
    maps kafka_topic to the topic, kafka_key to the key and kafka_value to the value, pgoutput,
    ``snapshot.mode=no_data``, connector and worker defaults otherwise, but for its producers'
    ``compression.type``, below);
  - the harvester in-process with default limits (``auto``) and tuned limits (500 / 5000), with the
    mark-purge/reset source and with the log source (its own publication and ``pgoutput`` slot,
    created before the round's idle phase): until all N records are on the topic, and until the
    outbox is empty;
  - the harvester with the log source and a 2-second retention window: until all N records are on
    the topic, until the slot is confirmed past the burst (delivery: PostgreSQL's CPU to there),
    and until the window's bulk delete emptied the outbox (delivery + sweep, its CPU to there; the
    sweep runs once the stored position passed a cut taken after the burst, which an idle leader
    stores within 10 s, then one to two windows later);
  - the harvester with a table-less outbox (the log source reading logical messages): the same N
    records written in one transaction as ``pg_logical_emit_message`` calls (the writing backend's
    CPU is left out, as the COPY's), until all N records are on the topic, and until the slot is
    confirmed past the burst (nothing to delete).
Every relay's count of records on its topic is read the same way, from outside its hot path: the
sum of the topic's end offsets, every 50 ms.
``--relays`` picks some of them (Debezium's always runs: the ratios are to it).
Both relays' producers compress alike, ``--compression`` (default ``lz4``, the harvester's default;
Kafka Connect's worker gets it as ``producer.compression.type``; ``none`` is Kafka's default): a
relay that compresses pays for it in its own CPU and in the broker's, on the same two cores.
Then each relay (Debezium, the harvester with each source at default limits) carries a steady insert
rate (``--rate`` records/s for ``--seconds``, bench/steady.py): commit-to-receipt latency p50/p99
and CPU per record. Relays alternate their order each round; the burst table prints medians:
records/s, the ratio to Debezium's rate, the median of the ratios round by round (each round's
relays run back to back, so the machine's drift from round to round cancels out) with their range,
and CPU seconds per 1,000 records of the relay process (the Connect JVM; this Python process and
its producer process for the harvester) and of the PostgreSQL server (every backend of the
private postmaster, Debezium's WAL sender included, but the benchmark's own session: its COPY, and
its probes of whether the outbox is empty yet), its WAL senders' part of it (the harvester's default
log source deletes what it delivered, and its WAL sender decodes those deletes too), and that CPU's
ratio to Debezium's, and of the Kafka broker (the local one: both relays' producers cost it, on
the same two cores).
Autovacuum is counted the same way for every relay: a run within the measurement is in
PostgreSQL's CPU (the notes say how many ran), the vacuum of the dead rows left at its end is not
(the mark-purge store's own vacuums during the drain are). In the steady phase, the retention
window's bulk deletes run within the measurement too (all but the last window or two's).

Ceilings (bench/ceilings.py), measured in every round among the relays (their order alternating
with them) over the same burst: ``decode``, the WAL sender decoding the committed burst through
pgoutput with the log source's options (protocol 2, streaming, binary, its publication; the slot
made before the COPY) into ``pg_recvlogical``, started at the commit, exiting at the commit's end
(``--endpos``); ``produce``, one producer with the harvester's producer settings sending the same
records; ``delete``, one connection draining a pre-loaded copy of the burst with ``DELETE …
RETURNING`` of 500 rows a statement (bench/harvest.py's single-write ceiling, the polling source's).
A second table prints each relay's share of each ceiling (the median of the rounds' ratios, with
their range) and its resident memory (bench/rss.py): the relay's processes' resident size when the
burst's write began and their peak from then to the end of its measurement (the harvester: this
process and its producer process, the bench's own consumer and, table-less, the burst's messages
built in this process included), for Debezium beside its JVM's heap (the largest in use before a
collection, and committed, from its collection log).

The machine's load average is printed at the start and the end: above about 1 per core the figures
are noisy (the ratios within one round hold better than the rates). A broker started less than
two minutes before (``./dev.sh bench`` starts the services) is waited for first, as its JVM still
compiles: in a run on one, the harvester's relays drained 9-17% slower than in the next run (the
log source 96,139 records/s against 115,194), Debezium not.

``--json PATH`` writes the run as one JSON object, for a renderer of the README's table:
  - ``version`` (1), ``date`` (UTC, ISO 8601), ``command``, ``seconds`` (the run's length);
  - ``machine``: ``cpus``, ``load_start`` and ``load_end`` (the 1, 5, 15-minute load averages),
    ``platform``;
  - ``workload``: ``records``, ``keys``, ``value_bytes``, ``partitions``, ``compression``,
    ``spread``, ``rounds``, ``steady_rate``, ``steady_seconds``;
  - ``versions``: ``postgresql``, ``kafka_connect``, ``debezium``;
  - ``ceilings``: per kind (``decode``, ``produce``, ``delete``; those that ran), one object per round:
    ``rate`` (records/s) and CPU s per 1,000 records ``cpu_client`` (pg_recvlogical; the producing
    process), ``cpu_postgres``, ``cpu_walsender``, ``cpu_broker`` (null where not measured: ``delete``);
  - ``relays``: per ``--relays`` name, ``label``, ``source`` (``debezium``, ``mark_purge``, ``log``,
    ``retain``, ``messages``), ``tuned`` and ``rounds``, one object per round with every field of
    ``peer_bursts.Burst``: ``rate``; CPU s per 1,000 records ``cpu_relay``, ``cpu_postgres``,
    ``cpu_walsender``, ``cpu_broker``; ``rate_empty``, ``extra``, ``cpu_postgres_swept``,
    ``rate_swept``, ``autovacuums``, ``gc_seconds``, ``gc_collections``; ``rss_start``, ``rss_peak``
    (MiB), ``rss_exact``; ``jvm_heap`` (Debezium: ``collections``, ``peak_used``, ``committed``, MiB;
    else null); ``cpu_postgres_kinds`` (``cpu_postgres`` by kind of server process: ``walsender``,
    ``backend``, ``autovacuum``, ``checkpointer``, ...; ``exited``: processes that exited meanwhile);
  - ``summary``: per relay name, the medians over the rounds: ``rate``, ``cpu_relay``,
    ``cpu_postgres``, ``cpu_walsender``, ``cpu_broker``; ``vs_debezium`` (``median``, ``min``,
    ``max`` of the rounds' rate ratios); ``cpu_relay_vs_debezium``, ``cpu_postgres_vs_debezium``;
    ``shares``, per ceiling kind, ``median``, ``min``, ``max`` of the rounds' ratios of the relay's
    rate to the ceiling's; ``rss_start_mib`` (median), ``rss_peak_mib`` (largest), ``rss_exact``;
    ``jvm_heap_peak_used_mib``, ``jvm_heap_committed_mib`` (largest; null but for Debezium);
  - ``steady``: per relay name (default limits only) ``inserted`` (records/s), ``p50_ms``,
    ``p99_ms``, ``cpu_relay``, ``cpu_postgres``, ``missing``.
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import tempfile
import time
from collections.abc import Callable
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import cpu
import harvest
import psycopg
import workload
from ceilings import Ceiling, decode_ceiling, produce_ceiling
from debezium_connect import DEBEZIUM_VERSION, KAFKA_VERSION, ConnectWorker, resolve_jars
from peer_bursts import LOG, MARK_PURGE, MESSAGES, RETAIN, RETENTION, SPREAD_PARTS, Burst, Source, copy_burst
from peer_relays import RelayContext, debezium_burst, debezium_relay, harvester_burst, harvester_relay, steady_through
from peer_report import document, report, report_ceilings, report_shares, report_steady
from peer_services import PARTITIONS, TUNED, LogicalPostgres, MissingError
from steady import Steady
from workload import VALUE

from harvester import Limits

# How long the broker has run before a run starts: with one started a minute before (its JVM's
# compiler at work) the log source drained 1,000,000 records at 1.56x Debezium's rate, 2.09x in the
# run after it.
WARM_BROKER_SECONDS = 120.0


def warm_broker() -> None:
    """Wait until the bench's broker has run for WARM_BROKER_SECONDS (saying so)."""
    broker = cpu.listener(cpu.bootstrap_port())
    age = None if broker is None else cpu.process_age(broker)
    if age is not None and age < WARM_BROKER_SECONDS:
        print(f"the broker started {age:.0f} s ago: waiting {WARM_BROKER_SECONDS - age:.0f} s for its JVM to warm up")
        time.sleep(WARM_BROKER_SECONDS - age)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=200_000, help="records in the burst")
    p.add_argument("--large", action="store_true", help="a burst of 1,000,000 records")
    p.add_argument("--rounds", type=int, default=2)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--rate", type=float, default=2000.0, help="records/s of the steady phase (0: none)")
    p.add_argument("--seconds", type=float, default=20.0, help="length of the steady phase")
    p.add_argument(
        "--compression",
        default="lz4",
        choices=("lz4", "none", "snappy", "zstd", "gzip"),
        help="compression.type of both relays' producers (default lz4, the harvester's default)",
    )
    p.add_argument(
        "--spread",
        type=float,
        default=0.0,
        help="seconds the burst's transaction pauses in all, in 20 pauses between COPYs of its rows (default 0)",
    )
    p.add_argument(
        "--relays",
        default=",".join(RELAYS),
        help=f"comma-separated, of {', '.join(RELAYS)} (Debezium always runs: the ratios are to it)",
    )
    p.add_argument(
        "--ceilings",
        default=",".join(CEILINGS),
        help=f"comma-separated, of {', '.join(CEILINGS)}, or none (measured each round, beside the relays)",
    )
    p.add_argument("--json", type=Path, help="also write the run's figures to this file (fields: above)")
    args = p.parse_args()
    chosen = {r.strip() for r in args.relays.split(",") if r.strip()} | {"debezium"}
    unknown = chosen - set(RELAYS)
    if unknown:
        sys.exit(f"peers: unknown relay(s) {', '.join(sorted(unknown))}; choose from {', '.join(RELAYS)}")
    ceilings = {c.strip() for c in args.ceilings.split(",") if c.strip()} - {"none"}
    if ceilings - set(CEILINGS):
        unknown = ceilings - set(CEILINGS)
        sys.exit(f"peers: unknown ceiling(s) {', '.join(sorted(unknown))}; choose from {', '.join(CEILINGS)}")
    options = Options(
        1_000_000 if args.large else args.records,
        args.keys,
        args.rounds,
        args.rate,
        args.seconds,
        chosen,
        ceilings,
        args.compression,
        args.spread,
        args.json,
    )
    try:
        run(options)
    except MissingError as e:
        sys.exit(f"peers: {e}")


# --relays names: (burst label, source, tuned limits); the steady phase runs each source's default.
RELAYS: dict[str, tuple[str, Source, bool]] = {
    "debezium": ("Debezium PostgreSQL + EventRouter", "", False),
    "mark-purge": ("harvester, default limits (auto)", MARK_PURGE, False),
    "mark-purge-tuned": ("harvester, tuned 500 / 5000", MARK_PURGE, True),
    "log": ("harvester, log source, default limits", LOG, False),
    "log-tuned": ("harvester, log source, tuned 500 / 5000", LOG, True),
    "log-retention": (f"harvester, log source, retention {RETENTION:.0f}s", RETAIN, False),
    "tableless": ("harvester, table-less, default limits", MESSAGES, False),
    "tableless-tuned": ("harvester, table-less, tuned 500 / 5000", MESSAGES, True),
}
CEILINGS = ("decode", "produce", "delete")
# The single-write ceiling's statement size: the tuned limits' largest mark (as bench/harvest.py's).
DELETE_BATCH = TUNED.mark_sizes[1]


@dataclass(frozen=True, slots=True)
class Options:
    records: int
    keys: int
    rounds: int
    rate: float
    seconds: float
    relays: set[str]
    ceilings: set[str]
    compression: str
    spread: float = 0.0
    json: Path | None = None


def _server(figure: Burst | Ceiling) -> str:
    """A relay's round: its PostgreSQL CPU per 1,000 records and by which kind of server process
    (a costly round says where its cost came from)."""
    if not isinstance(figure, Burst):
        return ""
    kinds = ", ".join(f"{kind} {seconds:.4f}" for kind, seconds in figure.cpu_postgres_kinds.items())
    return f"; PostgreSQL {figure.cpu_postgres:.4f} s/1000 ({kinds})"


def run(o: Options) -> None:
    resolve_jars()
    warm_broker()
    started, load_before = time.monotonic(), os.getloadavg()
    state = Path(tempfile.mkdtemp(prefix="peers-"))
    state.chmod(0o755)  # services.sh runs PostgreSQL as the postgres user when started as root
    pg = LogicalPostgres(state)
    connect = ConnectWorker(state / "connect", o.compression)
    try:
        pg.start()
        workload.DSN = pg.dsn  # bench/workload.py's helpers (run_engine) and harvest.ceiling_delete connect to it
        workload.PRODUCER = {"compression.type": o.compression}
        connect.start()
        if connect.proc is not None:  # a child of this process, not the in-process harvester's
            cpu.NOT_OURS.add(connect.proc.pid)
        print(
            f"workload: burst of {o.records} records COPied in one transaction"
            + (f" (pausing {o.spread:g} s in all between {SPREAD_PARTS} parts)" if o.spread else "")
            + f" into an idle outbox, {o.keys} keys,"
            f" {len(VALUE)}-byte values, {PARTITIONS} partitions; private PostgreSQL (wal_level=logical) on"
            f" 127.0.0.1:{pg.port}; Kafka Connect {KAFKA_VERSION} standalone + Debezium {DEBEZIUM_VERSION}"
            f" (pgoutput, EventRouter); producers' compression.type={o.compression}; {o.rounds} rounds, medians;"
            f" load average {load_before[0]:.1f} on {os.cpu_count()} CPUs at the start"
            + (" (a loaded machine: figures are noisy)" if load_before[0] > 1.0 else ""),
            flush=True,
        )

        def burst_of(source: Source, tuned: bool) -> Callable[[psycopg.Connection[Any], int], Burst]:
            if not source:
                return lambda c, r: debezium_burst(c, pg, connect, o.records, o.keys, r == 0, o.spread)
            limits = TUNED if tuned else Limits()
            return lambda c, _r: harvester_burst(c, o.records, o.keys, limits, source, o.spread)

        def ceiling_of(kind: str) -> Callable[[psycopg.Connection[Any], int], Ceiling]:
            if kind == "decode":
                return lambda c, _r: decode_ceiling(c, pg.dsn, o.records, o.keys, copy_burst)
            if kind == "produce":
                return lambda c, _r: produce_ceiling(c, o.records, o.keys)
            return lambda c, _r: Ceiling(harvest.ceiling_delete(c, o.records, o.keys, DELETE_BATCH))

        runs: list[tuple[str, str, Callable[[psycopg.Connection[Any], int], Burst | Ceiling]]] = [
            (f"{kind} ceiling", kind, ceiling_of(kind)) for kind in CEILINGS if kind in o.ceilings
        ]
        runs += [
            (label, name, burst_of(source, tuned))
            for name, (label, source, tuned) in RELAYS.items()
            if name in o.relays
        ]
        results: dict[str, list[Burst]] = {name: [] for name in RELAYS if name in o.relays}
        ceilings: dict[str, list[Ceiling]] = {kind: [] for kind in CEILINGS if kind in o.ceilings}
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            for r in range(o.rounds):
                for label, name, fn in runs if r % 2 == 0 else runs[::-1]:
                    figure = fn(conn, r)
                    if isinstance(figure, Ceiling):
                        ceilings[name].append(figure)
                    else:
                        results[name].append(figure)
                    print(f"  round {r + 1}: {label:<42} {figure.rate:9.0f} records/s{_server(figure)}", flush=True)
        labelled = {RELAYS[name][0]: bursts for name, bursts in results.items()}
        report(labelled, o.records)
        report_ceilings(ceilings, o.records)
        report_shares(labelled, ceilings)
        steadies: dict[str, Steady] = {}
        if o.rate > 0:

            def steady_relay(source: Source) -> Callable[[psycopg.Connection[Any]], RelayContext]:
                if not source:
                    return lambda c: debezium_relay(c, pg, connect)
                return lambda c: harvester_relay(c, Limits(), source)

            print(
                f"steady inserts: {o.rate:.0f} records/s for {o.seconds:.0f} s (2 writers, 10-record transactions);"
                " latency from commit to a consumer's receipt; CPU s per 1,000 records (PostgreSQL's includes"
                " the writers' backends)"
            )
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                for name, (label, source, tuned) in RELAYS.items():
                    if name not in o.relays or tuned:
                        continue
                    with steady_relay(source)(conn) as relay:
                        steadies[name] = steady_through(relay, o.rate, o.seconds, o.keys)
                        report_steady(label, steadies[name])
        took, load_after = time.monotonic() - started, os.getloadavg()
        print(f"took {took:.0f} s; load average {load_after[0]:.1f} at the end")
        if o.json is not None:
            with psycopg.connect(pg.dsn) as conn:
                row = conn.execute("SHOW server_version").fetchone()
            meta = {
                "version": 1,
                "date": datetime.now(UTC).isoformat(timespec="seconds"),
                "command": " ".join(["python", *sys.argv]),
                "machine": {
                    "cpus": os.cpu_count(),
                    "load_start": list(load_before),
                    "load_end": list(load_after),
                    "platform": platform.platform(),
                },
                "workload": {
                    "records": o.records,
                    "keys": o.keys,
                    "value_bytes": len(VALUE),
                    "partitions": PARTITIONS,
                    "compression": o.compression,
                    "spread": o.spread,
                    "rounds": o.rounds,
                    "steady_rate": o.rate,
                    "steady_seconds": o.seconds,
                },
                "versions": {
                    "postgresql": row[0] if row else None,
                    "kafka_connect": KAFKA_VERSION,
                    "debezium": DEBEZIUM_VERSION,
                },
                "seconds": took,
            }
            relays = {
                name: {"label": label, "source": source or "debezium", "tuned": tuned}
                for name, (label, source, tuned) in RELAYS.items()
                if name in o.relays
            }
            o.json.write_text(json.dumps(document(meta, relays, results, ceilings, steadies), indent=1) + "\n")
            print(f"wrote {o.json}")
    finally:
        try:
            connect.stop()
        finally:
            pg.stop()
            shutil.rmtree(state, ignore_errors=True)


if __name__ == "__main__":
    main()

"""A burst into an idle outbox, drained by the relay users would pick instead (Debezium's PostgreSQL
connector with its outbox EventRouter in Kafka Connect standalone) and by this project's harvester.

    ./dev.sh bench peers [--records 200000] [--large] [--rounds 2] [--keys 1000] [--rate 2000] [--seconds 20]
        [--relays debezium,mark-purge,mark-purge-tuned,log,log-tuned,log-retention,tableless,tableless-tuned]
        [--compression lz4] [--spread 0]

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
its producer process for the harvester) and of the PostgreSQL server (every backend of
the private postmaster, Debezium's WAL sender included, minus the COPYing backend's own time during
the COPY), its WAL senders' part of it (the harvester's default log source deletes what it
delivered, and its WAL sender decodes those deletes too), and that CPU's ratio to Debezium's, and
of the Kafka broker (the local one: both relays' producers cost it, on the same two cores).
Autovacuum is counted the same way for every relay: a run within the measurement is in
PostgreSQL's CPU (the notes say how many ran), the vacuum of the dead rows left at its end is not
(the mark-purge store's own vacuums during the drain are). In the steady phase, the retention
window's bulk deletes run within the measurement too (all but the last window or two's).
"""

from __future__ import annotations

import argparse
import contextlib
import shutil
import statistics
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import harvest
import psycopg
from confluent_kafka import Consumer, TopicPartition
from cpu import CollectorTime, CpuMeter, backend_pid, own_seconds, process_seconds
from debezium_connect import (
    DEBEZIUM_VERSION,
    KAFKA_VERSION,
    ConnectWorker,
    assert_running,
    connector_config,
    resolve_jars,
    streaming_connector,
)
from harvest import VALUE, fresh_outbox, fresh_topic, run_engine, stop, wait_empty
from peer_services import BOOTSTRAP, PARTITIONS, TUNED, LogicalPostgres, MissingError, drop_slot
from psycopg import sql
from steady import Steady, steady

from harvester import Limits, OutboxRecord, TableName
from harvester.postgres import logical, migrations
from harvester.postgres.log_retention import RetainingLogStore
from harvester.postgres.log_store import LogStore
from harvester.postgres.logical import LogSetup
from harvester.postgres.message_format import default_prefix, encode
from harvester.postgres.message_store import MessageStore

# The harvester's sources in this bench: rows marked and purged, rows read from the log, and a
# table-less outbox's logical messages read from the log.
Source = str
MARK_PURGE, LOG, RETAIN, MESSAGES = "mark_purge", "log", "retain", "messages"
# A burst's transaction spread over time (--spread) pauses after each of this many COPYs.
_SPREAD_PARTS = 20
# The retention window of RETAIN: short, so that the bulk delete of the burst's rows runs within the
# round and its cost is measured (a long window defers it past the round). Each sweep scans the
# table: in a burst, the burst's rows are scanned a few times before they are deleted (a long
# window scans a row about twice), so this figure is an upper bound of the sweep's cost.
RETENTION = 2.0


@dataclass(frozen=True, slots=True)
class Burst:
    rate: float  # records/s, commit to the last record on the topic (the sum of its end offsets)
    cpu_relay: float  # CPU s per 1,000 records: the relay process
    cpu_postgres: float  # ... and the PostgreSQL server
    cpu_walsender: float  # ... of which its WAL senders
    cpu_broker: float  # ... and the Kafka broker
    rate_empty: float | None = None  # harvester only: commit to empty outbox (or slot confirmed)
    extra: int = 0  # records beyond N on the topic (at-least-once duplicates)
    # A retention window: PostgreSQL CPU s per 1,000 records until the bulk delete emptied the
    # outbox (cpu_postgres then stops at delivery: the slot confirmed past the burst), and the rate
    # from the commit to then.
    cpu_postgres_swept: float | None = None
    rate_swept: float | None = None
    autovacuums: int = 0  # autovacuum/autoanalyze runs on the outbox counted within the measurement
    # In-process harvester: CPU s per 1,000 records spent in garbage collections (part of cpu_relay),
    # and how many ran, from the commit to the last record.
    gc_seconds: float | None = None
    gc_collections: int = 0


GOHARVEST_DDL = """CREATE TABLE {} (
  id BIGSERIAL PRIMARY KEY,
  create_time TIMESTAMPTZ NOT NULL DEFAULT now(),
  kafka_topic VARCHAR(249) NOT NULL,
  kafka_key VARCHAR(100) NOT NULL,
  kafka_value VARCHAR(10000),
  kafka_header_keys TEXT[] NOT NULL DEFAULT '{{}}',
  kafka_header_values TEXT[] NOT NULL DEFAULT '{{}}',
  leader_id UUID
)"""


def _backend_cpu(conn: psycopg.Connection[Any]) -> float:
    return process_seconds(backend_pid(conn))


def autovacuums(conn: psycopg.Connection[Any], table: TableName) -> int:
    """Autovacuum and autoanalyze runs on ``table`` so far (a fresh table: those within the round).
    The meter counts every backend of the server, so an autovacuum that runs within a relay's
    measurement is counted in its PostgreSQL CPU, one that runs after it is not, for every relay
    alike; this tells which ones had one."""
    row = conn.execute(
        "SELECT autovacuum_count + autoanalyze_count FROM pg_stat_user_tables WHERE relid = to_regclass(%s)",
        (table.quoted,),
    ).fetchone()
    return int(row[0]) if row else 0


def copy_burst(
    conn: psycopg.Connection[Any], table: TableName, topic: str, records: int, keys: int, spread: float = 0.0
) -> tuple[float, float]:
    """COPY the burst in one transaction (pausing ``spread`` seconds in all between its parts: a
    writer the walsender's decoding keeps up with); return (commit wall time, CPU s of the COPYing
    backend)."""
    cpu_before = _backend_cpu(conn)
    if spread:
        with conn.transaction():
            part = -(-records // _SPREAD_PARTS)
            for at in range(0, records, part):
                harvest.copy_part(conn, table, topic, range(at, min(at + part, records)), keys)
                time.sleep(spread / _SPREAD_PARTS)
    else:
        harvest.copy_rows(conn, table, topic, records, keys)
    committed = time.time()
    return committed, _backend_cpu(conn) - cpu_before


def emit_burst(conn: psycopg.Connection[Any], prefix: str, topic: str, records: int, keys: int) -> tuple[float, float]:
    """Write the burst as logical messages in one transaction; return (commit wall time, CPU s of
    the writing backend)."""
    payloads = [encode(OutboxRecord(topic=topic, key=f"key{i % keys}", value=VALUE)) for i in range(records)]
    emit = "SELECT count(pg_logical_emit_message(true, %s, p)) FROM unnest(%s::bytea[]) AS p"
    cpu_before = _backend_cpu(conn)
    with conn.transaction():
        for at in range(0, records, 20_000):
            conn.execute(emit, (prefix, payloads[at : at + 20_000]))
    committed = time.time()
    return committed, _backend_cpu(conn) - cpu_before


def wait_confirmed(conn: psycopg.Connection[Any], slot: str, lsn: str, timeout: float = 900) -> None:
    """Until ``slot`` is confirmed at or past ``lsn``."""
    probe = "SELECT confirmed_flush_lsn >= %s::pg_lsn FROM pg_replication_slots WHERE slot_name = %s"
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        row = conn.execute(probe, (lsn, slot)).fetchone()
        if row is not None and row[0]:
            return
        time.sleep(0.02)


def topic_count(consumer: Consumer, topic: str) -> int:
    return sum(consumer.get_watermark_offsets(TopicPartition(topic, p), timeout=10)[1] for p in range(PARTITIONS))


@dataclass(frozen=True, slots=True)
class Relay:
    """A relay running over an outbox of its own: where records go in and come out, and its CPU."""

    table: TableName
    topic: str
    cpu: Callable[[], float]  # CPU seconds of the relay's process so far
    in_process: bool  # the harvester runs in this process; Debezium in the Connect JVM
    prefix: str | None = None  # a table-less outbox's message prefix (records go in as messages)
    slot: str | None = None  # the harvester's slot with a log source
    keeps: bool = False  # delivered rows stay in the table (a retention window)


RelayContext = contextlib.AbstractContextManager[Relay]


@contextlib.contextmanager
def debezium_relay(conn: psycopg.Connection[Any], pg: LogicalPostgres, connect: ConnectWorker) -> Iterator[Relay]:
    """Debezium's connector with the EventRouter, streaming from a fresh goharvest outbox."""
    name = f"peers_{uuid.uuid4().hex[:8]}"
    table = TableName(name, "outbox")
    conn.execute(sql.SQL("CREATE SCHEMA {}").format(sql.Identifier(name)))
    conn.execute(sql.SQL(GOHARVEST_DDL).format(table.ident))
    topic = fresh_topic(PARTITIONS)
    try:
        with streaming_connector(conn, connect, name, connector_config(name, pg.dsn, table)):
            time.sleep(3.0)  # idle, as the harvester idles before its burst
            yield Relay(table, topic, connect.cpu, in_process=False)
    finally:
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(name)))


def debezium_burst(
    conn: psycopg.Connection[Any],
    pg: LogicalPostgres,
    connect: ConnectWorker,
    records: int,
    keys: int,
    check: bool,
    spread: float = 0.0,
) -> Burst:
    with debezium_relay(conn, pg, connect) as relay:
        consumer = Consumer(
            {"bootstrap.servers": BOOTSTRAP, "group.id": f"{relay.topic}_count", "enable.auto.commit": False}
        )
        try:
            meter = CpuMeter(conn)
            before, relay_before = meter.sample(), connect.cpu()
            committed, copy_cpu = copy_burst(conn, relay.table, relay.topic, records, keys, spread)
            schema = relay.table.schema
            assert schema is not None  # fresh_outbox's
            elapsed = (
                wait_published(consumer, relay.topic, records, lambda: assert_running(connect, schema)) - committed
            )
            after, relay_after = meter.sample(), connect.cpu()
            vacuums = autovacuums(conn, relay.table)
            if check:
                _check_record(relay.topic)
            time.sleep(1.0)
            extra = topic_count(consumer, relay.topic) - records
        finally:
            consumer.close()
    scale = 1000 / records
    return Burst(
        records / elapsed,
        (relay_after - relay_before) * scale,
        (after.postgres - before.postgres - copy_cpu) * scale,
        (after.walsender - before.walsender) * scale,
        (after.broker - before.broker) * scale,
        extra=extra,
        autovacuums=vacuums,
    )


def _check_record(topic: str) -> None:
    """The EventRouter put kafka_key in the key and kafka_value, unchanged, in the value."""
    c = Consumer(
        {
            "bootstrap.servers": BOOTSTRAP,
            "group.id": f"check_{uuid.uuid4().hex[:8]}",
            "auto.offset.reset": "earliest",
            "enable.auto.commit": False,
        }
    )
    try:
        c.assign([TopicPartition(topic, p, 0) for p in range(PARTITIONS)])
        deadline = time.monotonic() + 30
        while time.monotonic() < deadline:
            msg = c.poll(1.0)
            if msg is None or msg.error():
                continue
            key, value = (msg.key() or b"").decode(), (msg.value() or b"").decode()
            if not key.startswith("key") or value != VALUE:
                raise RuntimeError(f"Debezium's record is not the row's key/value: key={key!r} value={value[:60]!r}")
            return
        raise RuntimeError(f"could not read back a record of {topic}")
    finally:
        c.close()


@contextlib.contextmanager
def harvester_relay(
    conn: psycopg.Connection[Any], limits: Limits, source: Source, memory: int = 1 << 30
) -> Iterator[Relay]:
    """The harvester in-process over a fresh outbox with ``source`` (with the log, its publication
    and slot made first, and ``memory`` its logTransactionMemory; table-less, the outbox's table
    stays empty)."""
    table, topic = fresh_outbox(conn), fresh_topic(PARTITIONS)
    prefix = default_prefix(table) if source == MESSAGES else None
    # The bench's server is a single one: no failover to lose a table-less outbox's records.
    setup = LogSetup(table, f"{table.schema}_slot", f"{table.schema}_pub", prefix, accept_loss=True)
    log_store: LogStore | None = None
    if source != MARK_PURGE:
        migrations.ensure(conn, table, "fence")
        logical.create(conn, setup)
        every = limits.vacuum_every_records
        if source == RETAIN:
            log_store = RetainingLogStore(harvest.DSN, setup, RETENTION, vacuum_every=every, transaction_memory=memory)
        else:
            log_store = (MessageStore if source == MESSAGES else LogStore)(
                harvest.DSN, setup, vacuum_every=every, transaction_memory=memory
            )
        log_store.prepare()
    engine, store = run_engine(table, limits, store=log_store)
    try:
        time.sleep(3.0)  # idle marks: enough for PostgreSQL to consider generic plans
        slot = setup.slot if source != MARK_PURGE else None
        yield Relay(table, topic, own_seconds, in_process=True, prefix=prefix, slot=slot, keeps=source == RETAIN)
    finally:
        stop(engine, store)
        if source != MARK_PURGE:
            drop_slot(conn, setup.slot, setup.publication)
        assert table.schema is not None  # fresh_outbox's
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(table.schema)))


def wait_published(consumer: Consumer, topic: str, records: int, check: Callable[[], None] | None = None) -> float:
    """Wait, without asking the database, until ``topic`` holds ``records`` records; when (wall
    time). Every relay is measured so, from outside its hot path."""
    deadline = time.monotonic() + 900
    while (count := topic_count(consumer, topic)) < records:
        if time.monotonic() > deadline:
            raise RuntimeError(f"{count} of {records} records on {topic} after 900 s")
        if check is not None:
            check()
        time.sleep(0.05)
    return time.time()


def harvester_burst(
    conn: psycopg.Connection[Any],
    records: int,
    keys: int,
    limits: Limits,
    source: Source = MARK_PURGE,
    spread: float = 0.0,
) -> Burst:
    consumer = Consumer({"bootstrap.servers": BOOTSTRAP, "group.id": "harvester_count", "enable.auto.commit": False})
    with harvester_relay(conn, limits, source) as relay, contextlib.closing(consumer):
        meter = CpuMeter(conn)
        before = meter.sample()
        if relay.prefix is None:
            committed, copy_cpu = copy_burst(conn, relay.table, relay.topic, records, keys, spread)
        else:
            committed, copy_cpu = emit_burst(conn, relay.prefix, relay.topic, records, keys)
        own_after_copy = own_seconds()
        with CollectorTime() as collector:
            published = wait_published(consumer, relay.topic, records)
            if relay.prefix is None and not relay.keeps:
                # The table is probed only once all is published: a probe during the drain walks
                # the heap's dead rows from its start, PostgreSQL work the harvester does not do.
                wait_empty(conn, relay.table)
            else:  # nothing deleted now: done once the slot is confirmed past the burst
                row = conn.execute("SELECT pg_current_wal_lsn()::text").fetchone()
                assert relay.slot is not None and row is not None
                wait_confirmed(conn, relay.slot, str(row[0]))
        empty = time.time() - committed
        after = meter.sample()
        cpu_swept = rate_swept = None
        if relay.keeps:  # and until the window's bulk delete emptied the outbox
            wait_empty(conn, relay.table)
            rate_swept = records / (time.time() - committed)
            cpu_swept = (meter.sample().postgres - before.postgres - copy_cpu) * 1000 / records
        vacuums = autovacuums(conn, relay.table)
    scale = 1000 / records
    # The relay's CPU: this process after the commit (the COPY's client side ran before it).
    return Burst(
        records / (published - committed),
        (after.own - own_after_copy) * scale,
        (after.postgres - before.postgres - copy_cpu) * scale,
        (after.walsender - before.walsender) * scale,
        (after.broker - before.broker) * scale,
        rate_empty=records / empty,
        cpu_postgres_swept=cpu_swept,
        rate_swept=rate_swept,
        autovacuums=vacuums,
        gc_seconds=collector.seconds * scale,
        gc_collections=collector.collections,
    )


def steady_through(relay: Relay, rate: float, seconds: float, keys: int) -> Steady:
    return steady(
        harvest.DSN,
        BOOTSTRAP,
        relay.table,
        relay.topic,
        PARTITIONS,
        relay.cpu,
        in_process=relay.in_process,
        rate=rate,
        seconds=seconds,
        keys=keys,
        prefix=relay.prefix,
    )


# ---------------------------------------------------------------- main


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
    args = p.parse_args()
    records = 1_000_000 if args.large else args.records
    chosen = {r.strip() for r in args.relays.split(",") if r.strip()} | {"debezium"}
    unknown = chosen - set(RELAYS)
    if unknown:
        sys.exit(f"peers: unknown relay(s) {', '.join(sorted(unknown))}; choose from {', '.join(RELAYS)}")
    try:
        run(records, args.keys, args.rounds, args.rate, args.seconds, chosen, args.compression, args.spread)
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


def run(
    records: int,
    keys: int,
    rounds: int,
    rate: float,
    seconds: float,
    chosen: set[str],
    compression: str,
    spread: float = 0.0,
) -> None:
    resolve_jars()
    started = time.monotonic()
    state = Path(tempfile.mkdtemp(prefix="peers-"))
    state.chmod(0o755)  # services.sh runs PostgreSQL as the postgres user when started as root
    pg = LogicalPostgres(state)
    connect = ConnectWorker(state / "connect", compression)
    try:
        pg.start()
        harvest.DSN = pg.dsn  # bench/harvest.py's helpers (run_engine) connect to harvest.DSN
        harvest.PRODUCER = {"compression.type": compression}
        connect.start()
        print(
            f"workload: burst of {records} records COPied in one transaction"
            + (f" (pausing {spread:g} s in all between {_SPREAD_PARTS} parts)" if spread else "")
            + f" into an idle outbox, {keys} keys,"
            f" {len(VALUE)}-byte values, {PARTITIONS} partitions; private PostgreSQL (wal_level=logical) on"
            f" 127.0.0.1:{pg.port}; Kafka Connect {KAFKA_VERSION} standalone + Debezium {DEBEZIUM_VERSION}"
            f" (pgoutput, EventRouter); producers' compression.type={compression}; {rounds} rounds, medians",
            flush=True,
        )

        def burst_of(source: Source, tuned: bool) -> Callable[[psycopg.Connection[Any], int], Burst]:
            if not source:
                return lambda c, r: debezium_burst(c, pg, connect, records, keys, r == 0, spread)
            return lambda c, _r: harvester_burst(c, records, keys, TUNED if tuned else Limits(), source, spread)

        relays = [(label, burst_of(source, tuned)) for name, (label, source, tuned) in RELAYS.items() if name in chosen]
        results: dict[str, list[Burst]] = {name: [] for name, _ in relays}
        with psycopg.connect(pg.dsn, autocommit=True) as conn:
            for r in range(rounds):
                for name, fn in relays if r % 2 == 0 else relays[::-1]:
                    b = fn(conn, r)
                    results[name].append(b)
                    print(f"  round {r + 1}: {name:<42} {b.rate:9.0f} records/s", flush=True)
        report(results, records)
        if rate > 0:

            def steady_relay(source: Source) -> Callable[[psycopg.Connection[Any]], RelayContext]:
                if not source:
                    return lambda c: debezium_relay(c, pg, connect)
                return lambda c: harvester_relay(c, Limits(), source)

            steadies = {
                label: steady_relay(source)
                for name, (label, source, tuned) in RELAYS.items()
                if name in chosen and not tuned
            }
            print(
                f"steady inserts: {rate:.0f} records/s for {seconds:.0f} s (2 writers, 10-record transactions);"
                " latency from commit to a consumer's receipt; CPU s per 1,000 records (PostgreSQL's includes"
                " the writers' backends)"
            )
            with psycopg.connect(pg.dsn, autocommit=True) as conn:
                for name, relay_of in steadies.items():
                    with relay_of(conn) as relay:
                        report_steady(name, steady_through(relay, rate, seconds, keys))
        print(f"took {time.monotonic() - started:.0f} s")
    finally:
        try:
            connect.stop()
        finally:
            pg.stop()
            shutil.rmtree(state, ignore_errors=True)


def report(results: dict[str, list[Burst]], records: int) -> None:
    def med(values: list[float]) -> float:
        return statistics.median(values)

    first = next(iter(results.values()))
    debezium, debezium_pg = med([b.rate for b in first]), med([b.cpu_postgres for b in first])
    print(
        f"{'burst of ' + str(records):<44} {'records/s':>10} {'vs Debezium':>12} {'per round':>20}"
        f" {'CPU s/1000: relay':>18} {'PostgreSQL':>11} {'walsender':>10} {'vs Debezium':>12} {'broker':>7}  notes"
    )
    for name, bursts in results.items():
        rate, pg = med([b.rate for b in bursts]), med([b.cpu_postgres for b in bursts])
        paired = [b.rate / d.rate for b, d in zip(bursts, first, strict=True)]
        per_round = f"{med(paired):.2f}x ({min(paired):.2f}-{max(paired):.2f})"
        notes = []
        empties = [b.rate_empty for b in bursts if b.rate_empty is not None]
        if empties:
            done = "slot confirmed" if "table-less" in name or "retention" in name else "empty outbox"
            notes.append(f"to all records on the topic; to {done} {med(empties):.0f} records/s")
        else:
            notes.append("to all records on the topic")
        swept = [b.cpu_postgres_swept for b in bursts if b.cpu_postgres_swept is not None]
        if swept:  # the delivery's figure leaves the bulk delete out: this one has it
            swept_rate = med([b.rate_swept for b in bursts if b.rate_swept is not None])
            notes.append(
                f"PostgreSQL with the bulk delete (to empty outbox, {swept_rate:.0f} records/s):"
                f" {med(swept):.3f}, {med(swept) / debezium_pg:.1f}x Debezium"
            )
        extra = max(b.extra for b in bursts)
        if extra:
            notes.append(f"{extra} duplicates on the topic")
        collected = [b for b in bursts if b.gc_seconds is not None]
        if collected:
            gc_cpu = med([b.gc_seconds or 0.0 for b in collected])
            runs = med([float(b.gc_collections) for b in collected])
            notes.append(f"relay CPU in garbage collections {gc_cpu:.4f} ({runs:.0f} runs)")
        vacuums = sum(b.autovacuums for b in bursts)
        if vacuums:
            notes.append(f"{vacuums} autovacuum/autoanalyze runs within the measurement")
        print(
            f"{name:<44} {rate:10.0f} {rate / debezium:11.2f}x {per_round:>20}"
            f" {med([b.cpu_relay for b in bursts]):18.3f} {pg:11.3f} {med([b.cpu_walsender for b in bursts]):10.3f}"
            f" {pg / debezium_pg:11.1f}x {med([b.cpu_broker for b in bursts]):7.3f}  {'; '.join(notes)}"
        )


def report_steady(name: str, result: Steady) -> None:
    missing = f"; {result.missing} not received within 60 s" if result.missing else ""
    print(
        f"  {name:<42} inserted {result.inserted:6.0f}/s  p50 {result.p50_ms:6.1f} ms  p99 {result.p99_ms:7.1f} ms"
        f"  CPU relay {result.cpu_relay:.3f}, PostgreSQL {result.cpu_postgres:.3f}{missing}",
        flush=True,
    )


if __name__ == "__main__":
    main()

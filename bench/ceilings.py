"""What the machine allows a relay, measured in bench/peers.py's run over the same burst:

- the decode ceiling: PostgreSQL's WAL sender decoding the committed burst through ``pgoutput`` with
  the log source's options (protocol 2, streaming, binary values, its publication of the outbox's
  inserts; its session's ``logical_decoding_work_mem``) into ``pg_recvlogical``, which writes it to
  /dev/null: the slot is made before the COPY, ``pg_recvlogical`` starts at the commit and exits at
  the commit's end (``--endpos``); timed from the commit, as the relays are;
- the produce-only ceiling: one librdkafka producer with the harvester's producer settings
  (``producer_config``, the bench's compression) sending the same records (keys, 100-byte values,
  partitions, the three identity headers a reaper adds), a delivery callback per record (as the
  harvester has), timed from its first ``produce`` to the last acknowledgement. Its process runs
  alone too, to weigh producer-side levers without a database:
  ``python bench/ceilings.py TOPIC RECORDS KEYS '{"linger.ms": 5}' '{"headers": true, "callbacks": true}'``
  prints [records/s, CPU s].

Each comes with the CPU it cost per 1,000 records: the client (``pg_recvlogical``; the producing
process), PostgreSQL (for the decode ceiling all of it: its WAL sender exits with ``pg_recvlogical``,
so its time is not told apart) and the broker. The producer runs in a process of its own.
"""

from __future__ import annotations

import json
import resource
import shutil
import subprocess
import sys
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import workload
from confluent_kafka import Producer
from cpu import CpuMeter
from peer_services import BOOTSTRAP, PARTITIONS, MissingError, drop_slot
from psycopg import sql
from workload import VALUE, fresh_outbox, fresh_topic

from harvester import TableName
from harvester.core.identity import IdentityHeaders, Stamp
from harvester.kafka.publisher import producer_config
from harvester.postgres.connections import dsn_options
from harvester.postgres.log import logical
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.store import DECODING_OPTIONS
from harvester.postgres.schema import migrations

# How the burst is written (peer_bursts.copy_burst): it returns the commit's wall time.
CopyBurst = Callable[[psycopg.Connection[Any], TableName, str, int, int], float]


@dataclass(frozen=True, slots=True)
class Ceiling:
    rate: float  # records/s
    # CPU s per 1,000 records (None: not measured, the single-write ceiling's):
    cpu_client: float | None = None  # pg_recvlogical, or this process producing
    cpu_postgres: float | None = None  # PostgreSQL (all its processes)
    cpu_walsender: float | None = None  # ... of which its WAL senders
    cpu_broker: float | None = None  # the Kafka broker


def _children_seconds() -> float:
    usage = resource.getrusage(resource.RUSAGE_CHILDREN)
    return usage.ru_utime + usage.ru_stime


def pg_recvlogical() -> str:
    """The ``pg_recvlogical`` of the PostgreSQL the bench starts (its version's), else the one on PATH."""
    versioned = sorted(Path("/usr/lib/postgresql").glob("*/bin/pg_recvlogical"))
    found = str(versioned[-1]) if versioned else shutil.which("pg_recvlogical")
    if found is None:
        raise MissingError(
            "pg_recvlogical (PostgreSQL's client programs) is not installed: the decode ceiling needs it"
        )
    return found


def decode_ceiling(conn: psycopg.Connection[Any], dsn: str, records: int, keys: int, copy: CopyBurst) -> Ceiling:
    """The decode ceiling over a fresh outbox set up as the log source's (its publication and slot
    made before the COPY); ``copy(conn, table, topic, records, keys)`` writes the burst and returns
    the commit's wall time, as peer_bursts.copy_burst. PostgreSQL's CPU leaves out ``conn``'s
    backend, which writes the burst."""
    table = fresh_outbox(conn)
    assert table.schema is not None  # fresh_outbox's
    setup = LogSetup(table, f"{table.schema}_slot", f"{table.schema}_pub", None)
    migrations.ensure(conn, table, "fence")
    logical.create(conn, setup)
    command = [
        pg_recvlogical(),
        "--dbname",
        psycopg.conninfo.make_conninfo(dsn, options=f"{DECODING_OPTIONS} {dsn_options(dsn)}".strip()),
        "--slot",
        setup.slot,
        "--start",
        "--no-loop",
        "--file",
        "/dev/null",
        "--option",
        "proto_version=2",
        "--option",
        "streaming=on",
        "--option",
        f"publication_names={setup.publication}",
        "--option",
        "binary=true",
    ]
    try:
        meter = CpuMeter(conn, without_own=True)
        before = meter.sample()
        committed = copy(conn, table, "decode_ceiling", records, keys)
        row = conn.execute("SELECT pg_current_wal_insert_lsn()::text").fetchone()
        assert row is not None
        client_before = _children_seconds()
        done = subprocess.run(
            [*command, "--endpos", str(row[0])], capture_output=True, text=True, timeout=900, check=False
        )
        finished = time.time()
        client = _children_seconds() - client_before
        after = meter.sample()
        if done.returncode != 0:
            raise MissingError(f"pg_recvlogical failed: {done.stderr.strip()[-300:]}")
    finally:
        drop_slot(conn, setup.slot, setup.publication)
        conn.execute(sql.SQL("DROP SCHEMA {} CASCADE").format(sql.Identifier(table.schema)))
    scale = 1000 / records
    # The WAL sender exits with pg_recvlogical: its time is in the postmaster's reaped children's,
    # in cpu_postgres, not among the live WAL senders'.
    return Ceiling(
        records / (finished - committed),
        client * scale,
        (after.postgres - before.postgres) * scale,
        None,
        (after.broker - before.broker) * scale,
    )


def produce_ceiling(conn: psycopg.Connection[Any], records: int, keys: int) -> Ceiling:
    """The produce-only ceiling: the burst's records through one producer with the harvester's
    settings (``workload.PRODUCER`` over ``producer_config``'s defaults) into a fresh topic, in a
    process of its own (what librdkafka keeps allocated stays out of this process's memory, which
    the in-process harvester's figure holds)."""
    topic = fresh_topic(PARTITIONS)
    meter = CpuMeter(conn)
    before = meter.sample()
    done = subprocess.run(
        [sys.executable, __file__, topic, str(records), str(keys), json.dumps(workload.PRODUCER)],
        capture_output=True,
        text=True,
        timeout=900,
        check=False,
    )
    after = meter.sample()
    if done.returncode != 0:
        raise RuntimeError(f"produce-only ceiling failed: {done.stderr.strip()[-300:]}")
    rate, cpu = json.loads(done.stdout.strip().splitlines()[-1])
    scale = 1000 / records
    return Ceiling(rate, cpu * scale, None, None, (after.broker - before.broker) * scale)


def _produce(
    topic: str, records: int, keys: int, overrides: dict[str, str], headers: bool = True, callbacks: bool = True
) -> tuple[float, float]:
    """(records/s from the first produce to the last acknowledgement, CPU s of this process then).
    ``headers``: each record carries the three identity headers a reaper adds (id, epoch, producer);
    ``callbacks``: a delivery callback per record (without, all must be out of the queue at the end)."""
    producer = Producer(producer_config({"bootstrap.servers": BOOTSTRAP}, overrides))
    acked = 0

    def on_delivery(err: Any, _msg: Any) -> None:
        nonlocal acked
        acked += err is None

    value = VALUE.encode()
    key_bytes = [f"key{k}".encode() for k in range(keys)]
    stamp = Stamp.of(IdentityHeaders(), 1, b"profile")
    extra: dict[str, Any] = {"on_delivery": on_delivery} if callbacks else {}
    started, cpu = time.time(), time.process_time()  # process-wide: librdkafka's threads included
    for i in range(records):
        while True:
            try:
                carried: list[tuple[str, str | bytes | None]] | None = [*stamp.headers(i)] if headers else None
                producer.produce(topic, value=value, key=key_bytes[i % keys], headers=carried, **extra)
                break
            except BufferError:
                producer.poll(0.01)
        producer.poll(0)
    left = producer.flush(120)
    finished, cpu = time.time(), time.process_time() - cpu
    if (acked if callbacks else records - left) != records:
        raise SystemExit(f"produce-only ceiling: {acked} of {records} records acknowledged")
    return records / (finished - started), cpu


if __name__ == "__main__":  # the produce-only ceiling's process: TOPIC RECORDS KEYS PRODUCER-JSON [OPTIONS-JSON]
    options = json.loads(sys.argv[5]) if len(sys.argv) > 5 else {}
    print(json.dumps(_produce(sys.argv[1], int(sys.argv[2]), int(sys.argv[3]), json.loads(sys.argv[4]), **options)))

"""The main job on local defaults: migrate, harvest, write a few records, watch them arrive.

    python -m examples.demo [--records 10] [--config reaper.yaml]

Runs against the services of ``deploy/local/services.sh`` (``./dev.sh demo`` starts them; ``PGPORT``
and ``KAFKA_PORT`` move them, and the demo with them). It runs
the real daemon: ``reaper migrate`` and ``reaper run`` as a child process, writes records in one
application transaction with the stasher, consumes the topic, and stops the daemon with SIGTERM.
"""

from __future__ import annotations

import argparse
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import psycopg
from confluent_kafka import Consumer, KafkaError

from harvester.client.stasher import Stasher
from harvester.core.records import OutboxRecord
from harvester.kafka.topics import ensure_topic

DEFAULT_CONFIG = Path(__file__).resolve().parent.parent / "deploy" / "local" / "reaper.yaml"
# The local services' addresses; PGPORT and KAFKA_PORT move them, as for deploy/local/services.sh.
DSN = (
    f"host=127.0.0.1 port={os.environ.get('PGPORT', '5432')} user=harvester password=local-dev-secret dbname=harvester"
)
BOOTSTRAP = f"127.0.0.1:{os.environ.get('KAFKA_PORT', '9092')}"
TOPIC = "demo.orders"


def outbox_count(conn: psycopg.Connection[tuple[int]]) -> int:
    """The rows in the demo's outbox."""
    row = conn.execute("SELECT count(*) FROM outbox").fetchone()
    return int(row[0]) if row else 0


def main() -> int:
    """Run the demo; return the process exit code."""
    parser = argparse.ArgumentParser(description="Harvest a few outbox records into Kafka on local services.")
    parser.add_argument("--records", type=int, default=10, help="how many records to write (default 10)")
    parser.add_argument("--config", type=Path, default=DEFAULT_CONFIG, help="reaper.yaml to run with")
    args = parser.parse_args()
    reaper = [sys.executable, "-m", "harvester.daemon.cli"]
    env = dict(os.environ)
    if args.config == DEFAULT_CONFIG:  # the local services' file: their ports, as the environment moves them
        env["REAPER_HARVEST__DATA_SOURCE"] = DSN
        env["REAPER_HARVEST__BASE_KAFKA_CONFIG__BOOTSTRAP_SERVERS"] = BOOTSTRAP

    print(f"1. migrating the outbox: reaper migrate -f {args.config}")
    subprocess.run([*reaper, "migrate", "-f", str(args.config)], check=True, env=env)

    ensure_topic({"bootstrap.servers": BOOTSTRAP}, TOPIC, partitions=3)
    consumer = Consumer(
        {"bootstrap.servers": BOOTSTRAP, "group.id": f"demo-{uuid.uuid4().hex[:8]}", "auto.offset.reset": "latest"}
    )
    consumer.subscribe([TOPIC])
    while not consumer.assignment():  # join before writing, so only this run's records are shown
        consumer.poll(0.2)

    print(f"2. starting the harvester: reaper run -f {args.config}")
    daemon = subprocess.Popen(
        [*reaper, "run", "-f", str(args.config)], stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, env=env
    )
    try:
        run_id = uuid.uuid4().hex[:6]
        records = [
            OutboxRecord.of(
                TOPIC, f"customer-{i % 3}", f'{{"order": "{run_id}-{i}", "amount": {10 * i}}}', {"source": "demo"}
            )
            for i in range(args.records)
        ]
        with psycopg.connect(DSN) as conn, conn.transaction():
            # The application's own rows and its messages commit together, or not at all.
            conn.execute("CREATE TABLE IF NOT EXISTS demo_orders (id TEXT PRIMARY KEY, amount INT NOT NULL)")
            with conn.cursor() as cur:
                cur.executemany(
                    "INSERT INTO demo_orders VALUES (%s, %s)", [(f"{run_id}-{i}", 10 * i) for i in range(args.records)]
                )
            Stasher("outbox").stash(conn, records)
        print(f"3. wrote {len(records)} outbox records in one transaction (run {run_id})")

        print(f"4. reading them back from Kafka topic {TOPIC!r}:")
        seen = 0
        deadline = time.monotonic() + 60
        while seen < len(records) and time.monotonic() < deadline:
            msg = consumer.poll(0.5)
            if msg is None:
                continue
            err = msg.error()
            if err is not None:
                if err.code() == KafkaError._PARTITION_EOF:
                    continue
                raise RuntimeError(str(err))
            value = (msg.value() or b"").decode()
            if run_id not in value:
                continue
            seen += 1
            key = (msg.key() or b"").decode()
            print(f"   partition {msg.partition()} offset {msg.offset():>4}  key={key:<11} {value}")
        if seen < len(records):
            print(f"only {seen} of {len(records)} records arrived within 60 s", file=sys.stderr)
            return 1
        # A record is purged after its acknowledgement, a moment after it arrived: wait for that.
        with psycopg.connect(DSN, autocommit=True) as conn:
            deadline = time.monotonic() + 10
            while (left := outbox_count(conn)) and time.monotonic() < deadline:
                time.sleep(0.1)
        print(f"5. all {seen} records arrived; records left in the outbox: {left}")
        return 0
    finally:
        consumer.close()
        daemon.send_signal(signal.SIGTERM)
        try:
            daemon.wait(30)
        except subprocess.TimeoutExpired:
            daemon.kill()
        if daemon.returncode not in (0, -signal.SIGTERM):
            sys.stderr.write((daemon.stderr.read() if daemon.stderr else b"").decode()[-3000:])
        print(f"6. harvester stopped (exit code {daemon.returncode})")


if __name__ == "__main__":
    sys.exit(main())

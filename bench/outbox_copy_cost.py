"""Where the time of one COPY into the outbox goes: the floor under the Spark sink's commit.

    .venv/bin/python bench/outbox_copy_cost.py [--rows 1000000] [--rounds 2]

The Spark sink's commit inserts every row of a write into the outbox in one transaction, through one
backend: the same work as the single-connection COPY baseline of ``bench/spark_write.py``. This
bench times that COPY (the rows are encoded untimed, in PostgreSQL's text format) into
goharvest-layout tables that differ in one thing each, so the cost of the primary key, of the id
sequence and of the WAL can be read off against the real table (``outbox``), side by side in one run:

- ``outbox``: the outbox as ``reaper migrate`` creates it.
- ``no-pk``: the same without the primary key.
- ``explicit-ids``: ids supplied in the data instead of taken from the sequence.
- ``unlogged``: the same table, UNLOGGED (no WAL).

Only ``outbox`` is a table the harvester can use; the others show what each part costs. Needs the
local services (``deploy/local/services.sh start``); prints figures only.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import time
import uuid
from pathlib import Path

import psycopg
from psycopg import sql

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import migrate

PG_DSN = os.environ.get(
    "HARVESTER_TEST_PG_DSN", "host=127.0.0.1 port=5432 user=harvester password=local-dev-secret dbname=harvester"
)
Conn = psycopg.Connection[tuple[object, ...]]


def encoded(rows: int, with_ids: bool) -> bytes:
    """The bench rows of ``bench/spark_write.py`` in COPY text format, ids first when ``with_ids``."""
    lines = (f'bench.orders\tkey-{n % 1000}\t{{"order":{n},"status":"created","total":42.5}}\n' for n in range(rows))
    if with_ids:
        lines = (f"{n + 1}\t{line}" for n, line in enumerate(lines))
    return "".join(lines).encode()


def variant(conn: Conn, schema: str, label: str) -> TableName:
    """A fresh table for ``label``: the migrated outbox, then the one change the label names."""
    table = TableName(schema, f"{label.replace('-', '_')}_{uuid.uuid4().hex[:6]}")
    migrate(conn, table)
    if label == "no-pk":
        primary_key = sql.Identifier(f"{table.name}_pkey")
        conn.execute(sql.SQL("ALTER TABLE {} DROP CONSTRAINT {}").format(table.ident, primary_key))
    elif label == "unlogged":
        conn.execute(sql.SQL("ALTER TABLE {} SET UNLOGGED").format(table.ident))
    return table


def copy_seconds(table: TableName, data: bytes, with_ids: bool) -> float:
    """Seconds for one transaction that COPYs ``data`` into ``table``."""
    columns = ["id"] if with_ids else []
    columns += ["kafka_topic", "kafka_key", "kafka_value"]
    copy = sql.SQL("COPY {} ({}) FROM STDIN").format(table.ident, sql.SQL(", ").join(map(sql.Identifier, columns)))
    with psycopg.connect(PG_DSN) as conn:
        begin = time.perf_counter()
        with conn.cursor().copy(copy) as pipe:
            for start in range(0, len(data), 1 << 20):
                pipe.write(data[start : start + (1 << 20)])
        conn.commit()
        return time.perf_counter() - begin


def main() -> None:
    """Time every variant ``--rounds`` times, interleaved, and print the medians against ``outbox``."""
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--rows", type=int, default=1_000_000)
    parser.add_argument("--rounds", type=int, default=2)
    args = parser.parse_args()

    plain, numbered = encoded(args.rows, False), encoded(args.rows, True)
    labels = ["outbox", "no-pk", "explicit-ids", "unlogged"]
    schema = f"bench_{uuid.uuid4().hex[:8]}"
    seconds: dict[str, list[float]] = {label: [] for label in labels}
    with psycopg.connect(PG_DSN, autocommit=True) as conn:
        try:
            for round_no in range(1, args.rounds + 1):
                for label in labels:
                    table = variant(conn, schema, label)
                    conn.execute("CHECKPOINT")
                    with_ids = label == "explicit-ids"
                    took = copy_seconds(table, numbered if with_ids else plain, with_ids)
                    conn.execute(sql.SQL("DROP TABLE {}").format(table.ident))
                    print(f"round {round_no} {label:12s} {took:6.2f} s = {args.rows / took:>9,.0f} rows/s", flush=True)
                    seconds[label].append(took)
        finally:
            conn.execute(sql.SQL("DROP SCHEMA IF EXISTS {} CASCADE").format(sql.Identifier(schema)))
    median = {label: statistics.median(found) for label, found in seconds.items()}
    print(f"\nmedian of {args.rounds} rounds, {args.rows:,d} rows in one COPY:")
    for label, took in median.items():
        print(f"  {label:12s} {took:6.2f} s = {args.rows / took:>9,.0f} rows/s")
    base = median["outbox"]
    parts = {"primary key": "no-pk", "id sequence": "explicit-ids", "WAL": "unlogged"}
    costs = ", ".join(f"{part} ~ {base - median[label]:.2f} s" for part, label in parts.items())
    print(f"of the outbox's {base:.2f} s: {costs}")


if __name__ == "__main__":
    main()

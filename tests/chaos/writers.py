"""The writers: threads committing ``<key>:<seq>`` records and their ledger rows exactly once."""

from __future__ import annotations

import random
import threading
import time
import zlib
from collections.abc import Sequence
from typing import Any

import psycopg
from psycopg import errors, sql

from harvester import MessageStasher, OutboxRecord, Stasher
from harvester.postgres.schema.identifiers import TableName
from tests.chaos.services import Tables
from tests.chaos.settings import ChaosSettings


class Writers:
    """Writer threads inserting ``<key>:<seq>`` records continuously, several per transaction.

    Each thread owns disjoint keys (its share of the normal keys and of the hot keys) and writes
    each key's seqs in order. Every transaction also inserts its (key, seq) pairs into the ledger,
    whose primary key makes a retry idempotent: when a connection drops during COMMIT the outcome is
    unknown, the transaction is retried, and a unique violation on the ledger then proves that the
    earlier attempt committed (and rolls the retry back, so nothing is written twice).
    """

    def __init__(self, settings: ChaosSettings, dsn: str, tables: Tables, topics: Sequence[str]) -> None:
        self._settings = settings
        self._dsn = dsn
        self._tables = tables
        self._topics = list(topics)
        self._stop = threading.Event()
        self._lock = threading.Lock()
        self.next_seq: dict[str, int] = {}
        self.records = 0
        self.transactions = 0
        self.retries = 0
        self.recovered = 0  # retries that found the earlier attempt committed
        self.errors: list[str] = []
        normal = [f"k{i}" for i in range(settings.keys)]
        hot = [f"hot{i}" for i in range(settings.hot_keys)]
        self._threads = [
            threading.Thread(
                target=self._guarded,
                args=(w, normal[w :: settings.writers], hot[w :: settings.writers]),
                name=f"chaos-writer-{w}",
                daemon=True,
            )
            for w in range(settings.writers)
        ]

    def topic_of(self, key: str) -> str:
        """The topic a key always goes to (order is per key, so a key never changes topic)."""
        return self._topics[zlib.crc32(key.encode()) % len(self._topics)]

    def start(self) -> None:
        """Start the writer threads."""
        for t in self._threads:
            t.start()

    def stop(self) -> None:
        """Finish the current transactions and stop."""
        self._stop.set()
        for t in self._threads:
            t.join(60)

    def _guarded(self, writer: int, normal: list[str], hot: list[str]) -> None:
        try:
            self._run(writer, normal, hot)
        except Exception as exc:
            self.errors.append(f"writer {writer}: {type(exc).__name__}: {exc}")

    def _run(self, writer: int, normal: list[str], hot: list[str]) -> None:
        s = self._settings
        rng = random.Random(f"{s.seed}/writer/{writer}")
        stasher: Stasher | MessageStasher | DebeziumWriter
        if s.layout == "debezium":
            stasher = DebeziumWriter(self._tables.outbox)
        else:
            stasher = MessageStasher(self._tables.outbox) if s.log_messages else Stasher(self._tables.outbox)
        seqs = dict.fromkeys(normal + hot, 0)
        rate = s.records_per_second / s.writers
        conn: psycopg.Connection[Any] | None = None
        due = time.monotonic()
        large_due = due + s.large_every if s.large_every and writer == 0 else float("inf")
        try:
            while not self._stop.is_set():
                batch: list[tuple[str, int]] = []
                size = rng.randint(1, s.max_per_txn)
                if time.monotonic() >= large_due:
                    size, large_due = s.large_txn, large_due + s.large_every
                for _ in range(size):
                    key = hot[0] if hot and rng.random() < s.hot_share else rng.choice(normal)
                    batch.append((key, seqs[key]))
                    seqs[key] += 1
                conn = self._commit(conn, stasher, batch)
                with self._lock:
                    self.records += len(batch)
                    self.transactions += 1
                    for key, seq in batch:
                        self.next_seq[key] = seq + 1
                due = max(due + len(batch) / rate, time.monotonic() - 1.0)  # no burst after an outage
                self._stop.wait(max(0.0, due - time.monotonic()))
        finally:
            if conn is not None:
                conn.close()

    def _commit(
        self,
        conn: psycopg.Connection[Any] | None,
        stasher: Stasher | MessageStasher | DebeziumWriter,
        batch: list[tuple[str, int]],
    ) -> psycopg.Connection[Any]:
        """Commit ``batch`` exactly once, whatever happens to the connection; return the connection."""
        ledger = sql.SQL("INSERT INTO {} (key, seq) SELECT * FROM unnest(%s::text[], %s::int[])").format(
            self._tables.ledger.ident
        )
        records = [OutboxRecord(topic=self.topic_of(k), key=k, value=f"{k}:{q}") for k, q in batch]
        attempt = 0
        while True:
            try:
                if conn is None or conn.closed or conn.broken:
                    conn = psycopg.connect(
                        self._dsn, autocommit=True, connect_timeout=3, application_name="chaos-writer"
                    )
                with conn.transaction():
                    conn.execute(ledger, ([k for k, _ in batch], [q for _, q in batch]))
                    stasher.stash(conn, records)
                return conn
            except errors.UniqueViolation:
                if attempt == 0:
                    raise  # a seq written twice on the first try is a harness bug, not an outcome
                assert conn is not None  # the violation came from a statement on it
                with self._lock:
                    self.recovered += 1
                return conn
            except psycopg.OperationalError:
                if conn is not None:
                    conn.close()
                conn = None
                attempt += 1
                with self._lock:
                    self.retries += 1
                time.sleep(min(1.0, 0.1 * attempt))


class DebeziumWriter:
    """Writes records as the Quarkus and Spring outbox extensions do into Debezium's layout: each row
    inserted (EventRouter's default columns; the topic in aggregatetype, routed unchanged) and
    deleted in the same transaction, so it exists only in the log."""

    def __init__(self, outbox: TableName) -> None:
        self._insert = sql.SQL(
            "INSERT INTO {} (aggregatetype, aggregateid, payload, type)"
            " SELECT t, k, v, 'chaos' FROM unnest(%s::text[], %s::text[], %s::text[]) AS u(t, k, v) RETURNING id"
        ).format(outbox.ident)
        self._delete = sql.SQL("DELETE FROM {} WHERE id = ANY(%s)").format(outbox.ident)

    def stash(self, conn: psycopg.Connection[Any], records: Sequence[OutboxRecord]) -> None:
        columns = ([r.topic for r in records], [r.key for r in records], [str(r.value) for r in records])
        ids = [row[0] for row in conn.execute(self._insert, columns)]
        conn.execute(self._delete, (ids,))

"""De-duplicating reader for consumers of harvested topics.

The harvester publishes at least once: a record can reach Kafka again after a delivery that failed
but landed, a forced remark, or a failover. Every copy carries the same identity headers
(:mod:`harvester.core.identity`), so a reader can tell a re-delivery from a new record by its
(producer, outbox id). :class:`DedupReader` wraps a confluent-kafka consumer and drops re-deliveries;
it never drops a record whose identity it has not seen. What it remembers, and why that catches
every duplicate the harvester produces, is :class:`harvester.client.dedup_state.DedupState`'s.

Checkpointing follows the consumer-checkpoint idea of Gazette: the reader's state and the
consumer's next offsets are written in the same database transaction as the effects of the messages
they cover (:meth:`DedupReader.checkpoint`), and a restarted consumer resumes from exactly that
point (:meth:`DedupReader.load`, then :meth:`DedupReader.on_assign` or :meth:`DedupReader.assign`).
"""

from __future__ import annotations

import time
from collections.abc import Mapping
from typing import Any

import psycopg
import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from prometheus_client import CollectorRegistry, Counter
from psycopg import sql
from psycopg.types.json import Jsonb

from harvester.client.dedup_state import DEFAULT_CAPACITY, DEFAULT_DEPTH, DEFAULT_TERMS, DedupState
from harvester.core.identity import Identity, IdentityHeaders
from harvester.postgres.schema.identifiers import TableName

log = structlog.get_logger("harvester.dedup")

DEFAULT_TABLE = "harvester_dedup_checkpoint"
DEFAULT_HEADERS = IdentityHeaders()

__all__ = ["DedupReader", "DedupState"]


class DedupReader:
    """A confluent-kafka consumer that skips re-deliveries of harvested records.

    Messages without identity headers, and error events, pass through untouched. Use one reader per
    consumer, from one thread. For exactly-once processing, disable ``enable.auto.commit`` and
    store the reader's :meth:`checkpoint` in the transaction that applies the messages' effects.
    Pass ``cooperative=True`` when the consumer subscribes with cooperative rebalancing (see
    :meth:`on_assign`).
    """

    def __init__(
        self,
        consumer: Consumer,
        *,
        headers: IdentityHeaders = DEFAULT_HEADERS,
        capacity: int = DEFAULT_CAPACITY,
        depth: int = DEFAULT_DEPTH,
        terms: int = DEFAULT_TERMS,
        registry: CollectorRegistry | None = None,
        cooperative: bool = False,
    ) -> None:
        self.consumer = consumer
        self.cooperative = cooperative
        self.headers = headers
        self.registry = registry if registry is not None else CollectorRegistry()
        self._dropped_metric = Counter(
            "harvester_dedup_duplicates_dropped",
            "Re-deliveries of an outbox record dropped by the de-duplicating reader.",
            registry=self.registry,
        )
        self._evicted_metric = Counter(
            "harvester_dedup_state_evictions",
            "Remembered identities dropped to keep the reader's state bounded, by bound (key, term, depth).",
            ["reason"],
            registry=self.registry,
        )
        self.state = DedupState(
            capacity=capacity, depth=depth, terms=terms, on_evict=lambda r: self._evicted_metric.labels(r).inc()
        )
        self._dropped = 0
        self._next: dict[tuple[str, int], int] = {}

    @property
    def duplicates_dropped(self) -> int:
        """Re-deliveries this reader dropped since it was created."""
        return self._dropped

    def positions(self) -> dict[tuple[str, int], int]:
        """Per (topic, partition), the offset after the last message this reader consumed."""
        return dict(self._next)

    # ------------------------------------------------------------------ reading

    def poll(self, timeout: float | None = None) -> Message | None:
        """The next message that is not a re-delivery, or None when ``timeout`` (seconds) passes.
        None or a negative timeout waits indefinitely, like ``Consumer.poll``."""
        deadline = None if timeout is None or timeout < 0 else time.monotonic() + timeout
        while True:
            left = -1.0 if deadline is None else max(0.0, deadline - time.monotonic())
            msg = self.consumer.poll(left)
            if msg is None:
                return None
            if self._keep(msg):
                return msg
            if deadline is not None and time.monotonic() >= deadline:
                return None

    def consume(self, num_messages: int = 1, timeout: float | None = None) -> list[Message]:
        """Like ``Consumer.consume``, without re-deliveries: may return fewer than ``num_messages``."""
        batch = self.consumer.consume(num_messages, -1.0 if timeout is None else timeout)
        return [m for m in batch if self._keep(m)]

    def _keep(self, msg: Message) -> bool:
        topic, partition, offset = msg.topic(), msg.partition(), msg.offset()
        if msg.error() is not None or topic is None or partition is None or offset is None:
            return True
        self._next[(topic, partition)] = offset + 1
        identity = self._identity(msg)
        if identity is None:
            return True
        key = msg.key()
        if not self.state.observe((identity.producer, topic, key), identity):
            return True
        self._dropped += 1
        self._dropped_metric.inc()
        log.debug(
            "duplicate_dropped",
            producer=identity.producer,
            id=identity.id,
            epoch=identity.epoch,
            key=None if key is None else key.decode("utf-8", "replace"),
            topic=topic,
            partition=partition,
            offset=offset,
        )
        return False

    def _identity(self, msg: Message) -> Identity | None:
        raw = msg.headers() or []
        pairs = raw.items() if isinstance(raw, dict) else raw
        # A consumed message's header values are bytes; the client's typing also allows str.
        found = [(k, v.encode() if isinstance(v, str) else v) for k, v in pairs]
        return Identity.from_headers(found, self.headers)

    # ------------------------------------------------------------------ state and offsets

    def snapshot(self) -> dict[str, Any]:
        """The de-duplication state as a JSON-compatible dict (see :meth:`DedupState.snapshot`)."""
        return self.state.snapshot()

    def restore(self, state: Mapping[str, Any], offsets: Mapping[str, Mapping[str, int]] | None = None) -> None:
        """Load a :meth:`snapshot`, and the offsets to start from (``{topic: {partition: offset}}``)
        that :meth:`on_assign` and :meth:`assign` will apply."""
        self.state.restore(state)
        self._next = {(t, int(p)): int(o) for t, parts in (offsets or {}).items() for p, o in parts.items()}

    def offsets(self) -> dict[str, dict[str, int]]:
        """The consumer's next offsets as JSON (``{topic: {partition: offset}}``)."""
        out: dict[str, dict[str, int]] = {}
        for (topic, partition), offset in sorted(self._next.items()):
            out.setdefault(topic, {})[str(partition)] = offset
        return out

    def on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        """``on_assign`` callback for ``Consumer.subscribe``: starts each partition this reader has a
        position for (read or restored) there, the others where the group would.

        With eager rebalancing (the default assignors) ``partitions`` replace the assignment; a reader
        made with ``cooperative=True`` adds them to it instead, as the ``cooperative-sticky``
        assignor and ``group.protocol=consumer`` require.
        """
        started = self._with_offsets(partitions)
        try:
            if self.cooperative:
                consumer.incremental_assign(started)
            else:
                consumer.assign(started)
        except KafkaException as e:
            if e.args[0].code() != KafkaError._STATE:
                raise
            # librdkafka refuses the call that does not match the group's rebalance protocol.
            raise RuntimeError(
                f"the consumer's rebalance protocol does not match DedupReader(cooperative={self.cooperative}):"
                f" create the reader with cooperative={not self.cooperative}"
            ) from e

    def assign(self, partitions: list[TopicPartition]) -> None:
        """Assign ``partitions`` to the consumer, starting each at this reader's position if it has one."""
        self.consumer.assign(self._with_offsets(partitions))

    def _with_offsets(self, partitions: list[TopicPartition]) -> list[TopicPartition]:
        for tp in partitions:
            # The state covers exactly the messages before these offsets: resuming anywhere else
            # would skip records or re-read ones whose copies the state may no longer catch.
            position = self._next.get((tp.topic, tp.partition))
            if position is not None:
                tp.offset = position
        return partitions

    # ------------------------------------------------------------------ database checkpoints

    def checkpoint(self, conn: psycopg.Connection[Any], name: str, *, table: str = DEFAULT_TABLE) -> None:
        """Save state and offsets under ``name`` in the caller's current transaction, so they commit
        (or roll back) together with the effects of the messages read so far. Creates the table on
        first use."""
        target = TableName.parse(table)
        _ensure_table(conn, target)
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (reader, state, offsets, updated_at) VALUES (%s, %s, %s, now()) "
                "ON CONFLICT (reader) DO UPDATE SET state = EXCLUDED.state, offsets = EXCLUDED.offsets, "
                "updated_at = EXCLUDED.updated_at"
            ).format(target.ident),
            (name, Jsonb(self.snapshot()), Jsonb(self.offsets())),
        )

    @classmethod
    def load(
        cls, conn: psycopg.Connection[Any], name: str, consumer: Consumer, *, table: str = DEFAULT_TABLE, **options: Any
    ) -> DedupReader:
        """A reader over ``consumer`` restored from the checkpoint ``name`` (fresh if there is none).
        Then subscribe with ``on_assign=reader.on_assign``, or call :meth:`assign`."""
        reader = cls(consumer, **options)
        target = TableName.parse(table)
        if _table_exists(conn, target):
            row = conn.execute(
                sql.SQL("SELECT state, offsets FROM {} WHERE reader = %s").format(target.ident), (name,)
            ).fetchone()
            if row is not None:
                reader.restore(row[0], row[1])
        return reader


def _table_exists(conn: psycopg.Connection[Any], table: TableName) -> bool:
    row = conn.execute("SELECT to_regclass(%s) IS NOT NULL", (table.quoted,)).fetchone()
    return bool(row and row[0])


def _ensure_table(conn: psycopg.Connection[Any], table: TableName) -> None:
    if not _table_exists(conn, table):
        conn.execute(
            sql.SQL(
                "CREATE TABLE IF NOT EXISTS {} (reader text PRIMARY KEY, state jsonb NOT NULL, "
                "offsets jsonb NOT NULL, updated_at timestamptz NOT NULL DEFAULT now())"
            ).format(table.ident)
        )

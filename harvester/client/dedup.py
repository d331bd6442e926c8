"""De-duplicating reader for consumers of harvested topics.

The harvester publishes at least once: a record can reach Kafka again after a delivery that failed
but landed, a forced remark, or a failover. Every copy carries the same identity headers
(:mod:`harvester.core.identity`), so a reader can tell a re-delivery from a new record by its
(producer, outbox id). :class:`DedupReader` wraps a confluent-kafka consumer and drops re-deliveries;
it never drops a record whose identity it has not seen.

Why "drop if id <= highest seen" is wrong: outbox ids are taken at insert time and become visible at
commit, so two transactions writing the same key can publish id 11 before id 10. Only an exact
match of an id already seen is dropped.

What is remembered, per (producer, topic, key) and per epoch (leadership term) of that key:

* ``stack``: the ids of that term, most recent last, that no higher id of the same term has
  followed yet (a strictly decreasing list; at most ``depth`` long);
* ``first``: the first ``depth`` distinct ids the term published in that key.

Why this catches every duplicate the harvester produces (engine facts, see
:mod:`harvester.core.engine`): per key at most one record is in flight, and a key's next record is sent
only after the previous one was acknowledged and purged.

1. A live re-publication of X (remark after a failed delivery, or a new leader re-marking X because
   the old one never purged it) is preceded, since X's previous copy, only by ids lower than X of
   its key: anything higher waits behind X, and a remark or a new term marks in id order. So X is
   still on the stack of the term that sent the previous copy.
2. A fenced zombie can still hold X in librdkafka's queue and deliver it late, after newer terms'
   records of the key (at most one such copy per key per zombie term). Its earlier copy was sent
   either by the zombie's own term (X is on that term's stack, by 1.) or by the first later term
   that published it, which sent X after only the lower, late-committed ids of the key: X is
   among that term's ``first`` ids.

The Spark drain (``readStream.format("outbox")``) publishes a whole micro-batch at once, many records
of a key in flight, and a failed batch is replayed with its epoch, ids and order: 1. does not hold,
so its copies carry the batch number and the id of the key's record before them in the batch
(``previous``, absent for the key's first). Per key, the reader keeps the latest (epoch, batch) and
``high``, the end of the chain of that batch's records it read from the key's first one on, each
link checked by ``previous``: every record of the key in that batch up to ``high`` was read, so a
copy of the same (epoch, batch) with an id at or below ``high`` is a re-delivery. (A record between
two links of one attempt that an earlier attempt held was deleted in between, that is purged by a
newer term, which published it.) A copy whose ``previous`` is not ``high`` (a record before it was
lost with a failed attempt) leaves the chain as it is: ids are never dropped on a guess.

So the state suffices when a key has fewer than ``depth`` late-committed lower ids pending at once,
the zombie terms still to be heard from are among the key's ``terms`` most recent epochs, and the
key stays among the ``capacity`` most recently read keys until its re-delivery arrives. State
dropped to keep those bounds is counted by ``harvester_dedup_state_evictions``.

Checkpointing follows the consumer-checkpoint idea of Gazette: the reader's state and the
consumer's next offsets are written in the same database transaction as the effects of the messages
they cover (:meth:`DedupReader.checkpoint`), and a restarted consumer resumes from exactly that
point (:meth:`DedupReader.load`, then :meth:`DedupReader.on_assign` or :meth:`DedupReader.assign`).
"""

from __future__ import annotations

import base64
import time
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

import psycopg
import structlog
from confluent_kafka import Consumer, KafkaError, KafkaException, Message, TopicPartition
from prometheus_client import CollectorRegistry, Counter
from psycopg import sql
from psycopg.types.json import Jsonb

from harvester.core.identity import Identity, IdentityHeaders
from harvester.postgres.identifiers import TableName

log = structlog.get_logger("harvester.dedup")

DEFAULT_CAPACITY = 100_000
DEFAULT_DEPTH = 4
DEFAULT_TERMS = 4
DEFAULT_TABLE = "harvester_dedup_checkpoint"
DEFAULT_HEADERS = IdentityHeaders()
_STATE_VERSION = 2
_STATE_VERSIONS = (1, 2)  # version 1 had no batch chains

StreamKey = tuple[str, str, bytes | None]
"""(producer, topic, message key): the unit within which the harvester orders records."""


@dataclass(slots=True)
class _Term:
    first: list[int] = field(default_factory=list)
    stack: list[int] = field(default_factory=list)


@dataclass(slots=True)
class _Chain:
    """A key's latest Spark micro-batch: every record of the key in it up to ``high`` was read
    (None: its first record was not, so nothing is known)."""

    epoch: int
    batch: int
    high: int | None


class DedupState:
    """The bounded memory of record identities seen, independent of any Kafka client.

    ``capacity`` bounds the keys remembered (least recently read first out), ``terms`` the epochs
    per key, ``depth`` the ids per epoch (see the module docstring for why these bounds suffice).
    ``on_evict`` is told the reason (``key``, ``term`` or ``depth``) whenever state is dropped.
    Not thread-safe: one reader thread owns it.
    """

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        depth: int = DEFAULT_DEPTH,
        terms: int = DEFAULT_TERMS,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if capacity < 1 or depth < 1 or terms < 1:
            raise ValueError("capacity, depth and terms must be at least 1")
        self.capacity = capacity
        self.depth = depth
        self.terms = terms
        self._on_evict = on_evict
        self._keys: OrderedDict[StreamKey, dict[int, _Term]] = OrderedDict()
        self._chains: dict[StreamKey, _Chain] = {}  # keys whose latest record came from the Spark drain

    def __len__(self) -> int:
        return len(self._keys)

    def observe(self, stream: StreamKey, identity: Identity) -> bool:
        """Record one copy of ``identity`` read in ``stream``; True if it re-delivers a remembered id."""
        terms = self._keys.get(stream)
        if terms is None:
            terms = self._keys[stream] = {}
            if len(self._keys) > self.capacity:
                evicted, _ = self._keys.popitem(last=False)
                self._chains.pop(evicted, None)
                self._evicted("key")
        else:
            self._keys.move_to_end(stream)
        rid = identity.id
        duplicate = any(rid in t.stack or rid in t.first for t in terms.values())
        if identity.batch is not None:
            duplicate = self._chained(stream, identity) or duplicate
        term = terms.get(identity.epoch)
        if term is None:
            term = terms[identity.epoch] = _Term()
            if len(terms) > self.terms:
                del terms[min(terms)]
                self._evicted("term")
        self._remember(term, rid)
        return duplicate

    def _chained(self, stream: StreamKey, identity: Identity) -> bool:
        """Follow the key's chain in its micro-batch; True if the copy is at or below its end."""
        assert identity.batch is not None
        chain = self._chains.get(stream)
        if chain is None or (chain.epoch, chain.batch) != (identity.epoch, identity.batch):
            start = identity.id if identity.previous is None else None
            self._chains[stream] = _Chain(identity.epoch, identity.batch, start)
            return False
        if chain.high is not None and identity.id <= chain.high:
            return True
        if chain.high is not None and identity.previous == chain.high:
            chain.high = identity.id
        return False

    def _remember(self, term: _Term, rid: int) -> None:
        if len(term.first) < self.depth and rid not in term.first:
            term.first.append(rid)
        stack = term.stack
        # A higher id of the same term means every lower one before it was purged: never re-sent live.
        while stack and stack[-1] < rid:
            stack.pop()
        if not stack or stack[-1] != rid:
            stack.append(rid)
            if len(stack) > self.depth:
                del stack[0]
                self._evicted("depth")

    def _evicted(self, reason: str) -> None:
        if self._on_evict is not None:
            self._on_evict(reason)

    def snapshot(self) -> dict[str, Any]:
        """The state as a compact JSON-compatible dict (keys in least-recently-read order)."""
        producers: dict[str, int] = {}
        topics: dict[str, int] = {}
        entries: list[list[Any]] = []
        for stream, terms in self._keys.items():
            producer, topic, key = stream
            entry: list[Any] = [
                producers.setdefault(producer, len(producers)),
                topics.setdefault(topic, len(topics)),
                None if key is None else base64.b64encode(key).decode("ascii"),
                [[epoch, list(t.first), list(t.stack)] for epoch, t in terms.items()],
            ]
            chain = self._chains.get(stream)
            if chain is not None:
                entry.append([chain.epoch, chain.batch, chain.high])
            entries.append(entry)
        return {"version": _STATE_VERSION, "producers": list(producers), "topics": list(topics), "keys": entries}

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the state with a :meth:`snapshot`; bounds smaller than the saved ones trim it."""
        if snapshot.get("version") not in _STATE_VERSIONS:
            raise ValueError(f"unsupported dedup state version {snapshot.get('version')!r}")
        producers: list[str] = list(snapshot["producers"])
        topics: list[str] = list(snapshot["topics"])
        restored: OrderedDict[StreamKey, dict[int, _Term]] = OrderedDict()
        chains: dict[StreamKey, _Chain] = {}
        for pi, ti, key, terms, *chain in snapshot["keys"]:
            stream = (producers[pi], topics[ti], None if key is None else base64.b64decode(key))
            if chain:
                epoch, batch, high = chain[0]
                chains[stream] = _Chain(int(epoch), int(batch), None if high is None else int(high))
            kept = sorted(terms, key=lambda t: int(t[0]))[-self.terms :]
            restored[stream] = {
                int(epoch): _Term([int(i) for i in first][: self.depth], [int(i) for i in stack][-self.depth :])
                for epoch, first, stack in kept
            }
        while len(restored) > self.capacity:
            restored.popitem(last=False)
        self._keys = restored
        self._chains = {stream: chain for stream, chain in chains.items() if stream in restored}


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

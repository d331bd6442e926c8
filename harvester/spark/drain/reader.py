"""The ``outbox`` streaming source: mark-purge/reset mapped onto a Spark micro-batch's life cycle.

- **Offsets** name records, not positions: an outbox is not a log (a transaction that commits late
  makes a lower id visible after higher ones were drained), so the end offset of a micro-batch holds,
  per shard, the ids it planned, the fence epoch it planned them under and a batch counter. Spark
  writes it to the checkpoint's offset log before the batch runs, so a replay reads exactly the
  same records.
- **Planning** (``latestOffset``, on the driver) takes a term per shard (an epoch bump of the
  shard's fence row, as a reaper's leadership start does) once per driver, then reads the next
  ids of each shard under that epoch (:meth:`PostgresStore.pending`), skipping those of the batch
  before, whose purge may still be pending.
- **Reading** (``read``, on an executor) fetches the planned ids of one shard, in id order: one
  input partition per shard, so every record of a key is in one partition, in order.
- **Committing** (``commit``, on the driver, once the sink committed the batch) purges the
  batch's ids under the shard's epoch. A batch that fails is never committed: its records stay,
  and Spark replays it from its offsets. When a newer term took a shard's fence (a second copy of
  the query, a reaper), planning and purging raise :class:`FencedError` and the query stops having
  changed nothing.

Spark commits a batch's offsets to the source when it plans the next batch, so when the outbox
runs dry the last batch's purge would wait for new records: planning then returns a batch with no
ids, whose only effect is the purge of the batch before.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Callable, Iterator, Mapping
from dataclasses import dataclass
from functools import partial
from typing import Any, TypeVar

import psycopg
from psycopg import sql
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow
from pyspark.sql.types import ArrayType, BinaryType, LongType, StringType, StructField, StructType

from harvester.core.identity import IdentityHeaders
from harvester.core.protocols import FencedError, ShardCountError, StoreError
from harvester.postgres.migrations import fence_table
from harvester.postgres.store import PostgresStore
from harvester.spark.drain.options import DrainConfigError, DrainOptions

# What the source yields: the columns Spark's Kafka sink reads (topic, key, value, headers) and the
# record's outbox id.
DRAIN_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("key", StringType(), True),
        StructField("value", BinaryType(), True),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType(), False), StructField("value", BinaryType(), True)]),
                False,
            ),
            False,
        ),
        StructField("id", LongType(), False),
    ]
)

Offset = dict[str, Any]
T = TypeVar("T")

# A broken connection (a restarted or failed-over server, a terminated backend) is re-opened by the
# store's next call: the driver retries a plan or a purge (both idempotent) a few times before the
# query fails, as a reaper backs off and retries. A fence is final.
_RETRY_PAUSES = (0.5, 2.0, 5.0)


def _retrying(call: Callable[[], T]) -> T:
    for pause in _RETRY_PAUSES:
        try:
            return call()
        except FencedError:
            raise
        except StoreError:
            time.sleep(pause)
    return call()


@dataclass(frozen=True, slots=True)
class ShardBatch(InputPartition):
    """One shard's part of a micro-batch: the ids to read and what their identity headers say."""

    shard: int
    epoch: int
    ids: tuple[int, ...]
    producer: str
    value_kind: str


@dataclass(frozen=True, slots=True)
class _Term:
    """The driver's hold on the outbox: one store per shard, each under a term of its own."""

    stores: tuple[PostgresStore, ...]
    producer: str
    value_kind: str

    @classmethod
    def take(cls, options: DrainOptions) -> _Term:
        first = PostgresStore(
            options.dsn,
            options.table,
            application_name="outbox-harvester-spark",
            identity=IdentityHeaders(options.header_prefix),
            producer_name=options.producer_name,
            shards=options.shards,
        )
        try:
            columns = first.prepare()
            stores = (first, *(first.sibling(i) for i in range(1, options.shards)))
            leader_id = uuid.uuid4()
            for store in stores:
                store.acquire(leader_id)
        except ShardCountError as exc:
            first.close()
            recorded = _recorded_shards(options)
            raise DrainConfigError(
                f"option shards is {options.shards} but {options.table} is harvested with {recorded} shards: "
                "use the number its reapers use (to change it, see docs/sharding.md)"
            ) from exc
        except BaseException:
            first.close()
            raise
        return cls(stores, first.producer, columns.limits.value_kind)

    def close(self) -> None:
        for store in self.stores:
            store.close()


def _recorded_shards(options: DrainOptions) -> str:
    """The number(s) of shards the outbox's fence rows record, for an error message."""
    fence = fence_table(options.table)
    query = sql.SQL("SELECT DISTINCT shards FROM {} WHERE outbox_table = %s ORDER BY 1").format(fence.ident)
    with psycopg.connect(options.dsn) as conn:
        found = [str(r[0]) for r in conn.execute(query, (options.table.qualified,))]
    return " or ".join(found) or "another number of"


def _shard_offset(offset: Mapping[str, Any], shard: int) -> Offset:
    found = offset.get(str(shard))
    return dict(found) if isinstance(found, Mapping) else {"epoch": 0, "batch": 0, "ids": []}


class OutboxStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The driver's side of the drain (planning and purging) and the executors' (reading).

    Spark builds a fresh reader to ship ``read`` to the executors, so the constructor only keeps
    the options: the database is first touched when the driver plans."""

    def __init__(self, options: DrainOptions) -> None:
        self.options = options
        self._term: _Term | None = None
        self._committed: dict[int, int] = {}  # shard -> the last batch number it purged
        self._until: int | None = None  # Trigger.AvailableNow: drain the ids up to this one, then stop

    def _held(self) -> _Term:
        if self._term is None:
            self._term = _Term.take(self.options)
        return self._term

    def initialOffset(self) -> Offset:  # noqa: N802
        """Nothing planned yet, in any shard."""
        return {"shards": self.options.shards}

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802
        """``Trigger.AvailableNow``: drain what the outbox holds now (up to its highest id), then stop."""
        self._until = _retrying(self._held().stores[0].head_id)

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802
        """At most ``maxRecordsPerTrigger`` records per micro-batch."""
        return ReadMaxRows(self.options.max_records)

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:  # noqa: N802
        """Plan the next micro-batch: per shard, the next ids under the shard's fence."""
        shards = self.options.shards
        if int(start.get("shards", shards)) != shards:
            raise DrainConfigError(
                f"option shards is {shards} but the checkpoint was written with {start['shards']} shards: "
                "start the query with a new checkpoint location to change it"
            )
        term = self._held()
        # A batch's ids are written into the checkpoint, so a batch is bounded even when the trigger
        # asks for everything available (``ReadAllAvailable``).
        total = self.options.max_records
        if isinstance(limit, ReadMaxRows):
            total = min(limit.max_rows, total)
        per_shard = max(1, total // shards)
        end: Offset = {"shards": shards}
        for shard, store in enumerate(term.stores):
            before = _shard_offset(start, shard)
            ids = _retrying(partial(store.pending, before["ids"], per_shard))
            if self._until is not None:
                ids = [i for i in ids if i <= self._until]
            purge_due = bool(before["ids"]) and self._committed.get(shard) != before["batch"]
            if ids or purge_due:
                end[str(shard)] = {"epoch": store.epoch, "batch": int(before["batch"]) + 1, "ids": ids}
            elif str(shard) in start:
                end[str(shard)] = before
        return end

    def partitions(self, start: Offset, end: Offset) -> list[ShardBatch]:
        """One input partition per shard that has records in this batch."""
        out: list[ShardBatch] = []
        for shard in range(self.options.shards):
            planned = _shard_offset(end, shard)
            if planned["ids"] and planned["batch"] != _shard_offset(start, shard)["batch"]:
                term = self._held()
                ids = tuple(planned["ids"])
                out.append(ShardBatch(shard, int(planned["epoch"]), ids, term.producer, term.value_kind))
        return out

    def read(self, partition: InputPartition) -> Iterator[tuple[Any, ...]]:
        """The planned records of one shard, in id order, with their identity headers (executor)."""
        assert isinstance(partition, ShardBatch)
        names = IdentityHeaders(self.options.header_prefix)
        identity = [(names.epoch, str(partition.epoch).encode()), (names.producer, partition.producer.encode())]
        value = "kafka_value::text" if partition.value_kind == "json" else "kafka_value"
        query = sql.SQL(
            "SELECT id, kafka_topic, kafka_key, " + value + ", kafka_header_keys, kafka_header_values"
            " FROM {} WHERE id = ANY(%s) ORDER BY id"
        ).format(self.options.table.ident)
        with (
            psycopg.connect(self.options.dsn, application_name="outbox-harvester-spark") as conn,
            conn.cursor(name="outbox_drain") as cur,
        ):
            cur.execute(query, (list(partition.ids),))
            # A planned record that is gone was purged by a newer term, which fenced this query.
            for rid, topic, key, raw, hkeys, hvalues in cur:
                headers = [
                    (k, v.encode("utf-8") if v is not None else b"")
                    for k, v in zip(hkeys or (), hvalues or (), strict=False)
                    if k is not None
                ]
                headers += [(names.id, str(rid).encode()), *identity]
                payload = raw.encode("utf-8") if isinstance(raw, str) else raw
                yield topic, key, payload, headers, rid

    def commit(self, end: Offset) -> None:
        """Purge the records of a batch the sink committed, under each shard's fence."""
        term = self._held()
        for shard, store in enumerate(term.stores):
            planned = _shard_offset(end, shard)
            if planned["ids"] and self._committed.get(shard) != planned["batch"]:
                _retrying(partial(store.purge, planned["ids"]))
            self._committed[shard] = int(planned["batch"])

    def stop(self) -> None:
        """Close the driver's connections."""
        if self._term is not None:
            self._term.close()
            self._term = None

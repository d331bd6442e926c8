"""One input partition of the drain, on an executor: a shard's planned records of a micro-batch,
read in id order with their identity headers, then either handed to Spark as Arrow batches (for
any sink) or published by the task itself (``option("publish", "true")``).

Publishing where the records are read spares each record a second Python worker and the JVM's
copy between the two (read, Arrow, JVM, Arrow, publish): the drain's CPU per record halves. The
task publishes as the ``outbox-publish`` sink's tasks do (:mod:`harvester.spark.publish.task`) and
moves what Kafka refused for good to the dead-letter table under the shard's fence before it ends,
so whatever sink the rows go to, the source's commit purges only records that are in Kafka or dead
letters. A task that fails leaves the batch uncommitted: Spark runs it again, or replays the batch,
and a record dead-lettered by the failed attempt is no longer in the outbox to be read again.
"""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass

import psycopg
import pyarrow as pa
from psycopg import sql
from pyspark.sql.datasource import InputPartition

from harvester.core.identity import IdentityHeaders, Stamp
from harvester.postgres.table.statements import id_array
from harvester.spark.drain.options import DrainOptions
from harvester.spark.drain.placement import Placement
from harvester.spark.drain.schema import DRAIN_ARROW_SCHEMA
from harvester.spark.publish.dead_letters import dead_letter
from harvester.spark.publish.task import Record, publish


@dataclass(frozen=True, slots=True)
class ShardBatch(InputPartition):
    """One shard's part of a micro-batch: the ids to read and what their identity headers say
    (``epoch``: the term that planned them), the shard's term now, under which refusals are
    dead-lettered (``term``: a newer one when a restarted query replays the batch), and which keys
    of them this task takes: those whose hash is ``part`` modulo ``parts``."""

    shard: int
    epoch: int
    term: int
    batch: int
    ids: tuple[int, ...]
    producer: str
    value_kind: str
    part: int = 0
    parts: int = 1


def records(options: DrainOptions, partition: ShardBatch, fetch: int) -> Iterator[Record]:
    """The planned records of one shard, in id order, with their identity headers, fetched ``fetch``
    rows per round trip. Each record also names its batch and the key's record before it there, by
    which the de-duplicating reader tells a replay's copies (:mod:`harvester.client.dedup`)."""
    names = IdentityHeaders(options.header_prefix)
    stamp = Stamp.of(names, partition.epoch, partition.producer.encode())
    batch = (names.batch, str(partition.batch).encode())
    before: dict[str | None, int] = {}  # key -> its last record read
    # Values as bytes whatever the column's type, and every column in binary: nothing to parse
    # from text or to encode again here.
    value = "kafka_value" if partition.value_kind == "bytes" else "convert_to(kafka_value::text, 'UTF8')"
    # Every record of a key in one task, so the task publishes a key's records in order.
    keys = " AND (hashtext(coalesce(kafka_key, '')) & 2147483647) %% %s = %s" if partition.parts > 1 else ""
    query = sql.SQL(
        "SELECT id, kafka_topic, kafka_key, " + value + ", kafka_header_keys, kafka_header_values"
        " FROM {} WHERE id = ANY(%s::bigint[])" + keys + " ORDER BY id"
    ).format(options.table.ident)
    params = (id_array(partition.ids), *((partition.parts, partition.part) if partition.parts > 1 else ()))
    with (
        psycopg.connect(options.dsn, application_name="outbox-harvester-spark") as conn,
        conn.cursor(name="outbox_drain", binary=True) as cur,
    ):
        cur.itersize = fetch
        cur.execute(query, params)
        # A planned record that is gone was purged by a newer term, which fenced this query.
        for rid, topic, key, raw, hkeys, hvalues in cur:
            headers: list[tuple[str, bytes | None]] = [
                (k, v.encode("utf-8") if v is not None else b"")
                for k, v in zip(hkeys or (), hvalues or (), strict=False)
                if k is not None
            ]
            headers.extend(stamp.headers(rid))
            headers.append(batch)
            previous = before.get(key)
            if previous is not None:
                headers.append((names.previous, str(previous).encode()))
            before[key] = rid
            yield Record(rid, topic, key, raw, headers)


def arrow_batches(options: DrainOptions, partition: ShardBatch, rows: int) -> Iterator[pa.RecordBatch]:
    """The shard's records as Arrow batches of up to ``rows`` rows of :data:`DRAIN_SCHEMA`: Spark takes
    them as they are, where rows would go through PySpark's converter, which cost this task more
    than reading them."""
    placement = Placement(options.kafka) if options.elected else None
    chunk: list[Record] = []
    for record in records(options, partition, rows):
        chunk.append(record)
        if len(chunk) == rows:
            yield _arrow(chunk, placement, partition.term)
            chunk = []
    if chunk:
        yield _arrow(chunk, placement, partition.term)


def _arrow(chunk: list[Record], placement: Placement | None, term: int) -> pa.RecordBatch:
    ids, topics, keys, values, headers = zip(*chunk, strict=True)
    partitions = [placement.partition(t, k) for t, k in zip(topics, keys, strict=True)] if placement else None
    columns = (topics, keys, values, headers, ids, partitions or [None] * len(ids), [term] * len(ids))
    arrays = [pa.array(c, type=f.type) for c, f in zip(columns, DRAIN_ARROW_SCHEMA, strict=True)]
    return pa.RecordBatch.from_arrays(arrays, schema=DRAIN_ARROW_SCHEMA)


def published(options: DrainOptions, partition: ShardBatch, fetch: int) -> tuple[int, int, int, int, int]:
    """Publish the shard's records as they are read; dead-letter what Kafka refused for good; return
    the task's row of :data:`PUBLISHED_SCHEMA`."""
    epoch = IdentityHeaders(options.header_prefix).epoch
    outcome = publish(options.kafka, records(options, partition, fetch), options.max_attempts, epoch)
    failures = [refusal.failure for refusal in outcome.refused]
    # None are moved when a newer term took the shard: they stay for its new owner, and the batch is
    # not purged under this term (reader._purge).
    moved = dead_letter(options.dsn, options.table, partition.term, failures, partition.batch)
    return partition.shard, partition.batch, partition.term, outcome.records, moved

"""The ``outbox`` streaming source: mark-purge/reset mapped onto a Spark micro-batch's life cycle.

- **Offsets** name records, not positions: an outbox is not a log (a transaction that commits late
  makes a lower id visible after higher ones were drained), so the end offset of a micro-batch holds,
  per shard, the ids it planned, the fence epoch it planned them under and a batch counter. Spark
  writes it to the checkpoint's offset log before the batch runs, so a replay reads exactly the
  same records.
- **Planning** (``latestOffset``, on the driver) takes a term on each shard the query leads (an
  epoch bump of the shard's fence row, as a reaper's leadership start does: every shard without a
  leader group, :mod:`harvester.spark.drain.leadership`), then reads the next ids of each such
  shard under that epoch (:meth:`PostgresStore.pending`), skipping those of the batch before,
  whose purge may still be pending, and dead-lettering the records Kafka would refuse every time
  (malformed rows, records too large for their topic). The next plan is made while a batch runs
  (:mod:`harvester.spark.drain.ahead`).
- **Reading** (``read``, on an executor) fetches the planned ids of one shard, in id order: one
  input partition per shard (``tasksPerShard`` splits a shard's keys by hash among that many), so
  every record of a key is in one partition, in order. With
  ``option("publish", "true")`` the task publishes them too (:mod:`harvester.spark.drain.task`).
- **Committing** (``commit``, on the driver, once the sink committed the batch) purges the
  batch's ids under the term its tasks dead-lettered under (the shard's term when the batch was
  handed out: after a restart, the new term); if the shard's term changed since, the batch is
  planned again instead. A batch that fails is never committed: its records stay,
  and Spark replays it from its offsets. When a newer term took a shard's fence (a second copy of
  the query, a reaper), planning and purging raise :class:`FencedError`: without a leader group
  the query stops having changed nothing; in one, the shard is left to its new owner.

Spark commits a batch's offsets to the source when it plans the next batch, so when the outbox
runs dry the last batch's purge would wait for new records: planning then returns a batch with no
ids, whose only effect is the purge of the batch before.
"""

from __future__ import annotations

from collections.abc import Iterator
from functools import partial

import pyarrow as pa
import structlog
from pyspark.sql.datasource import DataSourceStreamReader, InputPartition
from pyspark.sql.streaming.datasource import ReadLimit, ReadMaxRows, SupportsTriggerAvailableNow

from harvester.core.identity import IdentityHeaders
from harvester.core.protocols import FencedError
from harvester.core.records import Failure
from harvester.postgres.table.rows import Pending
from harvester.spark.drain.ahead import PlanAhead, Work
from harvester.spark.drain.leadership import Shards
from harvester.spark.drain.limits import RecordLimits, overhead
from harvester.spark.drain.offsets import Offset, planned_ids, shard_offset, shard_part
from harvester.spark.drain.options import DrainConfigError, DrainOptions
from harvester.spark.drain.sizing import BatchSize
from harvester.spark.drain.task import ShardBatch, arrow_batches, published
from harvester.spark.retry import retrying

log = structlog.get_logger("harvester.spark.drain")

_FIRST_ASSIGNMENT = 30.0
"""Seconds ``Trigger.AvailableNow`` waits, in a leader group, for the query to lead a shard."""


class OutboxStreamReader(DataSourceStreamReader, SupportsTriggerAvailableNow):
    """The driver's side of the drain (planning and purging) and the executors' (reading).

    Spark builds a fresh reader to ship ``read`` to the executors, so the constructor only keeps
    the options: the database (and the leader group) is first touched when the driver plans."""

    chunk_rows = 4096
    """Rows per Arrow batch a task hands Spark, and per round trip of its cursor."""

    def __init__(self, options: DrainOptions) -> None:
        self.options = options
        self._shards: Shards | None = None
        self._committed: dict[int, int] = {}  # shard -> the last batch number it purged
        self._skipped: dict[int, int] = {}  # shard -> a batch not delivered (another leads the shard) or to plan again
        self._delivered: dict[int, tuple[int, int]] = {}  # shard -> its last batch handed out, and the term
        self._until: int | None = None  # Trigger.AvailableNow: drain the ids up to this one, then stop
        self._limits: RecordLimits | None = None  # the largest records Kafka takes, made at the first plan
        self._overhead = 0  # what publishing adds to a record's size (limits.overhead)
        # Sized by what the last batch took, unless the query set maxRecordsPerTrigger.
        self._size = BatchSize(options.shards) if options.sized else None
        self._per_shard = 0  # the last plan's share of each shard
        self._ahead = PlanAhead()  # the next plan, made while a batch runs

    def _held(self) -> Shards:
        if self._shards is None:
            self._shards = Shards(self.options)
        return self._shards

    def initialOffset(self) -> Offset:  # noqa: N802
        """Nothing planned yet, in any shard."""
        return {"shards": self.options.shards}

    def prepareForTriggerAvailableNow(self) -> None:  # noqa: N802
        """``Trigger.AvailableNow``: drain what the outbox holds now (up to its highest id), then stop;
        in a leader group, in the shards the query leads once it leads any."""
        shards = self._held()
        self._until = retrying(shards.stores[0].head_id)
        if self.options.elected:
            shards.wait_for_any(_FIRST_ASSIGNMENT)

    def getDefaultReadLimit(self) -> ReadLimit:  # noqa: N802
        """At most ``maxRecordsPerTrigger`` records per micro-batch (:mod:`.sizing` decides how many)."""
        return ReadMaxRows(self.options.max_records)

    def latestOffset(self, start: Offset, limit: ReadLimit) -> Offset:  # noqa: N802
        """Plan the next micro-batch: per shard led, the next ids under the shard's fence."""
        shards = self.options.shards
        if int(start.get("shards", shards)) != shards:
            raise DrainConfigError(
                f"option shards is {shards} but the checkpoint was written with {start['shards']} shards: "
                "start the query with a new checkpoint location to change it"
            )
        held = self._held()
        self._ahead.settle()
        led = held.lead()
        # A batch's ids are written into the checkpoint, so a batch is bounded even when the trigger
        # asks for everything available (``ReadAllAvailable``).
        total = self._size.next() if self._size is not None else self.options.max_records
        if isinstance(limit, ReadMaxRows):
            total = min(limit.max_rows, total)
        per_shard = self._per_shard = max(1, total // shards)
        planned = 0  # records of the shards that had their whole share
        full = 0  # and how many such shards
        end: Offset = {"shards": shards}
        for shard, store in enumerate(held.stores):
            before = shard_offset(start, shard)
            batch = int(before["batch"])
            done = planned_ids(before)
            ids: list[int] = []
            if shard in led:
                # The batch before may still be purged: skip its ids, unless it was not delivered.
                skip = [] if self._skipped.get(shard) == batch else done
                try:
                    ahead = self._ahead.take(shard, store.epoch, skip, per_shard, self._plan)
                    ids = ahead if ahead is not None else self._plan(shard, skip, per_shard)
                except FencedError as exc:
                    held.fenced(shard, exc)
                if len(ids) >= per_shard:
                    planned += len(ids)
                    full += 1
            purge_due = bool(done) and self._committed.get(shard) != batch
            if ids or purge_due:
                end[str(shard)] = shard_part(store.epoch, batch + 1, ids)
                if ids:
                    held.planned(shard, batch + 1)
            elif str(shard) in start:
                end[str(shard)] = before
        if self._size is not None:
            self._size.planned(planned, full)
        return end

    def _plan(self, shard: int, skip: list[int], limit: int) -> list[int]:
        """The ids of the next records of ``shard``. Those Kafka would refuse whatever the attempt,
        as a reaper finds after its attempts (the drain has one: it would fail every replay), are
        moved to the dead-letter table under the fence instead: malformed rows (no message can be
        made of them, :mod:`harvester.postgres.table.rows`) and records too large for their topic
        (:mod:`harvester.spark.drain.limits`)."""
        held = self._held()
        store = held.stores[shard]
        rows = retrying(partial(store.pending, skip, limit))
        if self._until is not None:
            rows = [row for row in rows if row.id <= self._until]
        bad = [self._refused(row) for row in rows]
        failures = [failure for failure in bad if failure is not None]
        if failures:
            retrying(partial(store.dead_letter, failures, held.term(shard)))
            for failure in failures:
                log.error("dead_lettered", id=failure.id, reason=failure.reason, error=failure.error, shard=shard)
        return [row.id for row, failure in zip(rows, bad, strict=True) if failure is None]

    def _refused(self, row: Pending) -> Failure | None:
        """Why Kafka would refuse ``row`` every time, as a dead letter, or None."""
        if row.malformed is not None:
            return Failure(row.id, "", "malformed", row.malformed, 1, None)
        if self._limits is None:
            kafka = self.options.kafka if self.options.elected else None
            self._limits = RecordLimits(self.options.max_record_bytes, kafka)
            self._overhead = overhead(IdentityHeaders(self.options.header_prefix), self._held().producer)
        size = row.size + self._overhead
        largest, setting = self._limits.limit(row.topic or "")
        if size <= largest:
            return None
        error = f"a record of up to {size} bytes with its headers, over {largest}, the {setting}"
        return Failure(row.id, "", "msg_size_too_large", error, 1, None)

    def partitions(self, start: Offset, end: Offset) -> list[ShardBatch]:
        """``tasksPerShard`` input partitions per shard that has records in this batch (and that this
        driver may deliver: a replayed batch of a shard another member leads now is left to it)."""
        self._ahead.settle()
        out: list[ShardBatch] = []
        for shard in range(self.options.shards):
            planned = shard_offset(end, shard)
            batch = int(planned["batch"])
            ids = planned_ids(planned)
            if not ids or batch == shard_offset(start, shard)["batch"]:
                continue
            held = self._held()
            if held.deliverable(shard, batch):
                # Spark runs a batch only after the one before completed, so that one's records are
                # delivered: purge them if this driver has not (it died before the source's commit).
                self._purge(shard, shard_offset(start, shard))
                # Stamped with the epoch it was planned under (a replay's copies are the same
                # records to the de-duplicating reader), dead-lettered under the shard's term now.
                epoch, term = int(planned["epoch"]), held.stores[shard].epoch
                self._delivered[shard] = (batch, term)
                shared, parts = tuple(ids), self.options.tasks_per_shard
                out.extend(
                    ShardBatch(shard, epoch, term, batch, shared, held.producer, held.value_kind, part, parts)
                    for part in range(parts)
                )
            else:
                self._skipped[shard] = batch
        # Each full shard's next ids, planned while the executors deliver these (not after a restart,
        # whose first batch is a replay: no plan of this driver's has sized a share yet).
        full = [p for p in out if self._per_shard and len(p.ids) >= self._per_shard]
        self._ahead.start({p.shard: Work(p.term, p.ids, self._per_shard) for p in full}, self._plan)
        return out

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch | tuple[int, int, int, int, int]]:
        """One shard's planned records (executor, :mod:`harvester.spark.drain.task`): as Arrow
        batches of up to :attr:`chunk_rows` rows, or published by this task, which yields one row."""
        assert isinstance(partition, ShardBatch)
        if self.options.publish:
            yield published(self.options, partition, self.chunk_rows)
        else:
            yield from arrow_batches(self.options, partition, self.chunk_rows)

    def commit(self, end: Offset) -> None:
        """Purge the records of a batch the sink committed, under each shard's fence."""
        held = self._held()
        self._ahead.settle()
        for shard in range(self.options.shards):
            planned = shard_offset(end, shard)
            self._purge(shard, planned)
            held.committed(shard, int(planned["batch"]))

    def _purge(self, shard: int, planned: Offset) -> None:
        """Purge a delivered batch's records of ``shard`` once (not those of a replay left undelivered),
        if this driver handed it out under the shard's term now (a batch a driver before it delivered
        had its refusals dead-lettered then)."""
        batch = int(planned["batch"])
        ids = planned_ids(planned)
        if ids and self._committed.get(shard) != batch and self._skipped.get(shard) != batch:
            held = self._held()
            store = held.stores[shard]
            delivered = self._delivered.get(shard)
            if delivered is not None and delivered[0] == batch and delivered[1] != store.epoch:
                # The term was taken back meanwhile (a fence, then this query's next term): a record
                # Kafka refused could not be dead-lettered under the old term, so nothing is purged
                # and the next plan takes the batch's records again (copies: at least once).
                self._skipped[shard] = batch
                log.info("batch_planned_again", shard=shard, batch=batch, under=delivered[1], term=store.epoch)
            else:
                try:
                    retrying(partial(store.purge, ids))
                except FencedError as exc:
                    held.fenced(shard, exc)  # in a leader group: the records are the new owner's
        self._committed[shard] = batch

    def stop(self) -> None:
        """Leave the leader group and close the driver's connections."""
        self._ahead.settle()
        if self._shards is not None:
            self._shards.close()
            self._shards = None

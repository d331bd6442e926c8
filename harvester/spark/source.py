"""The ``outbox`` Spark data source (PySpark Python Data Source API), batch and streaming."""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import (
    DataSource,
    DataSourceArrowWriter,
    DataSourceStreamArrowWriter,
    WriterCommitMessage,
)
from pyspark.sql.types import StructType

from harvester.spark import store
from harvester.spark.drain import DRAIN_SCHEMA, PUBLISHED_SCHEMA, DrainOptions, OutboxStreamReader
from harvester.spark.plan import SinkConfigError, WritePlan, resolve


@dataclass(frozen=True, slots=True)
class StagedPartition(WriterCommitMessage):
    """The commit message of one task: which attempt staged how many rows."""

    staged: store.Staged


def _task() -> tuple[int, int]:
    context = TaskContext.get()
    if context is None:  # called outside a Spark task (a direct call in a test or a tool)
        return 0, 0
    return int(context.partitionId()), int(context.attemptNumber())


def _stage(plan: WritePlan, batches: Iterator[Any]) -> StagedPartition:
    partition_id, attempt = _task()
    return StagedPartition(store.stage(plan, batches, partition_id, attempt))


def _unwrap(messages: Sequence[WriterCommitMessage | None]) -> list[store.Staged | None]:
    return [m.staged if isinstance(m, StagedPartition) else None for m in messages]


class OutboxWriter(DataSourceArrowWriter):
    """Batch writer: every partition is staged in parallel, the driver commits them all at once."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[Any]) -> StagedPartition:
        """Stage this task's partition (runs on an executor)."""
        return _stage(self.plan, iterator)

    def commit(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        """Insert one attempt per partition into the outbox, in one transaction."""
        store.publish(self.plan, _unwrap(messages))

    def abort(self, messages: Sequence[WriterCommitMessage | None]) -> None:
        """Drop everything this write staged; the outbox is not touched."""
        store.discard(self.plan, _unwrap(messages))


class OutboxStreamWriter(DataSourceStreamArrowWriter):
    """Streaming writer: each micro-batch is committed once per ``(sinkId, batchId)``."""

    def __init__(self, plan: WritePlan) -> None:
        self.plan = plan

    def write(self, iterator: Iterator[Any]) -> StagedPartition:
        """Stage this task's part of the micro-batch (runs on an executor)."""
        return _stage(self.plan, iterator)

    def commit(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Insert the micro-batch and record its id in one transaction; skip a batch already recorded."""
        store.publish(self.plan, _unwrap(messages), batchId)

    def abort(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Drop what the failed micro-batch staged."""
        store.discard(self.plan, _unwrap(messages))


class OutboxDataSource(DataSource):
    """Writes a DataFrame into a transactional outbox table, or drains one as a stream; see
    ``docs/spark.md`` for the options.

    Register it once per session with :func:`harvester.spark.register`, then use
    ``df.write.format("outbox")``, ``df.writeStream.format("outbox")`` or
    ``spark.readStream.format("outbox")``.
    """

    @classmethod
    def name(cls) -> str:
        """The format name: ``outbox``."""
        return "outbox"

    def _plan(self, schema: StructType, overwrite: bool, streaming: bool) -> WritePlan:
        if overwrite and not streaming:
            raise SinkConfigError("the outbox is append-only: use mode('append')")
        return resolve(self.options, schema, store.prepare, streaming)

    def writer(self, schema: StructType, overwrite: bool) -> OutboxWriter:
        """A batch writer; options and column types are checked here, before any task runs."""
        return OutboxWriter(self._plan(schema, overwrite, streaming=False))

    def streamWriter(self, schema: StructType, overwrite: bool) -> OutboxStreamWriter:  # noqa: N802
        """A streaming writer (any output mode: each micro-batch's rows become records)."""
        return OutboxStreamWriter(self._plan(schema, overwrite, streaming=True))

    def schema(self) -> StructType:
        """The drained records' columns (topic, key, value, headers, id, partition), or with
        ``publish`` a row per task that published them (shard, batch, term, records, dead_lettered)."""
        return PUBLISHED_SCHEMA if DrainOptions.parse(self.options).publish else DRAIN_SCHEMA

    def streamReader(self, schema: StructType) -> OutboxStreamReader:  # noqa: N802
        """Drain the outbox in micro-batches (``harvester.spark.drain``)."""
        return OutboxStreamReader(DrainOptions.parse(self.options))

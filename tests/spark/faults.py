"""An ``outbox`` data source that fails on purpose, for the failure-injection tests.

Options on top of the real ones:

- ``faultAt``: ``stage`` (a task raises after its rows are staged and committed to the staging
  table), ``commitBefore`` (the micro-batch commit raises before touching the database) or
  ``commitAfter`` (it raises after the database transaction committed, so Spark never records the
  batch as done);
- ``faultPartition`` / ``faultAttempt`` (for ``stage``; attempt ``-1`` means every attempt) or
  ``faultBatch`` (for the commit faults);
- ``faultHold``: ``1`` makes a commit fault leave its file and then hang instead of raising, for a
  test that kills the driver at that moment;
- ``faultAt=hold``: every row's value gets ``@p<partition>a<attempt>`` appended, and the first
  attempt of each task holds: on each executor, one task in the middle of its staging COPY, the
  others after their staging transaction committed; each leaves a file ``hold-<where>-p<partition>a<attempt>-<pid>``
  and waits for a file ``release`` (for the executor-loss test, which kills a worker meanwhile);
- ``faultAt=read`` (a stream read): the first attempt of shard ``faultPartition``'s task of its
  batch ``faultBatch`` yields half its records, leaves ``hold-read-p<partition>a0-<pid>`` and waits
  for ``release`` (for the drain's executor-loss test);
- ``faultDir``: a directory shared by driver and executors; each fault leaves a file there, which
  both proves it fired and makes a commit fault fire only once across query restarts.
"""

from __future__ import annotations

import os
import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import pyarrow as pa
import pyarrow.compute as pc
from pyspark import TaskContext
from pyspark.sql.datasource import InputPartition, WriterCommitMessage
from pyspark.sql.types import StructType

from harvester.spark import OutboxDataSource, OutboxStreamWriter, OutboxWriter, StagedPartition
from harvester.spark.drain import OutboxStreamReader, ShardBatch
from harvester.spark.drain.options import DrainOptions
from harvester.spark.drain.task import arrow_batches

# How long a held task or commit waits at most (so that a test gone wrong cannot hang a worker).
HOLD_SECONDS = 240.0


class InjectedError(RuntimeError):
    """Raised on purpose by this module."""


def _task() -> tuple[int, int]:
    context = TaskContext.get()
    assert context is not None, "this fault only fires inside a Spark task"
    return context.partitionId(), context.attemptNumber()


@dataclass(frozen=True)
class Fault:
    """Where to fail, read from the options."""

    at: str
    directory: str
    partition: int = -1
    attempt: int = -1
    batch: int = -1
    hold: bool = False

    @classmethod
    def of(cls, options: Any) -> Fault:
        """Read the fault options of a data source."""
        return cls(
            at=options["faultAt"],
            directory=options["faultDir"],
            partition=int(options.get("faultPartition", "-1")),
            attempt=int(options.get("faultAttempt", "-1")),
            batch=int(options.get("faultBatch", "-1")),
            hold=options.get("faultHold") == "1",
        )

    def fired(self) -> list[Path]:
        """The marker files of this kind of fault that fired so far."""
        return sorted(Path(self.directory).glob(f"{self.at}-*"))

    def fire(self, label: str) -> None:
        """Leave a marker file and raise (or hang, with ``faultHold``)."""
        (Path(self.directory) / f"{self.at}-{label}-{uuid.uuid4().hex[:8]}").touch()
        if self.hold:
            time.sleep(HOLD_SECONDS)
        raise InjectedError(f"injected fault {self.at} {label}")

    def after_stage(self) -> None:
        """Fail the task if it is the configured partition and attempt (executor side)."""
        partition, attempt = _task()
        if self.at == "stage" and partition == self.partition and self.attempt in (-1, attempt):
            self.fire(f"p{partition}a{attempt}")

    def where_to_hold(self) -> str | None:
        """For ``hold``: ``mid`` for the first task attempt 0 on this executor (its Python workers
        share a parent, the executor's Python daemon), ``after`` for the others, None on retries."""
        if self.at != "hold" or _task()[1] != 0:
            return None
        try:
            os.close(os.open(Path(self.directory) / f"slot-{os.getppid()}", os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return "after"
        return "mid"

    def wait(self, where: str) -> None:
        """Leave ``hold-<where>-p…a…-<pid>`` and wait for the test's ``release`` file."""
        partition, attempt = _task()
        directory = Path(self.directory)
        (directory / f"hold-{where}-p{partition}a{attempt}-{os.getpid()}").touch()
        deadline = time.monotonic() + HOLD_SECONDS
        while not (directory / "release").exists() and time.monotonic() < deadline:
            time.sleep(0.1)

    def in_commit(self, when: str, batch_id: int) -> None:
        """Fail the micro-batch commit once, at the configured batch and moment (driver side)."""
        if self.at == when and batch_id == self.batch and not self.fired():
            self.fire(f"b{batch_id}")


class FaultyWriter(OutboxWriter):
    """The batch writer, failing tasks after they staged their rows."""

    def __init__(self, writer: OutboxWriter, fault: Fault) -> None:
        super().__init__(writer.plan)
        self.fault = fault

    def write(self, iterator: Iterator[Any]) -> StagedPartition:
        """Stage as usual, then maybe fail; or, for ``hold``, tag the rows and hold on the way."""
        if self.fault.at != "hold":
            message = super().write(iterator)
            self.fault.after_stage()
            return message
        where = self.fault.where_to_hold()
        message = super().write(self._tagged(iterator, where == "mid"))
        if where == "after":
            self.fault.wait(where)
        return message

    def _tagged(self, batches: Iterator[Any], hold: bool) -> Iterator[Any]:
        partition, attempt = _task()
        tag = pa.scalar(f"@p{partition}a{attempt}")
        for n, batch in enumerate(batches):
            index = batch.schema.get_field_index(self.plan.value_column)
            value = pc.binary_join_element_wise(batch.column(index), tag, "")
            yield batch.set_column(index, self.plan.value_column, value)
            if n == 0 and hold:  # the first batch is in the COPY, whose transaction is open
                self.fault.wait("mid")


class FaultyStreamWriter(OutboxStreamWriter):
    """The streaming writer, failing a micro-batch commit before or after its transaction."""

    def __init__(self, writer: OutboxStreamWriter, fault: Fault) -> None:
        super().__init__(writer.plan)
        self.fault = fault

    def commit(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Commit as usual, failing around it when configured to."""
        self.fault.in_commit("commitBefore", batchId)
        super().commit(messages, batchId)
        self.fault.in_commit("commitAfter", batchId)


class FaultyStreamReader(OutboxStreamReader):
    """The drain's reader, holding one task in the middle of its shard's records."""

    chunk_rows = 10  # Arrow batches small enough that some go to the sink before the task holds

    def __init__(self, options: DrainOptions, fault: Fault) -> None:
        super().__init__(options)
        self.fault = fault

    def read(self, partition: InputPartition) -> Iterator[pa.RecordBatch]:
        """Read as usual; for ``read``, hold halfway through the configured shard batch's first attempt."""
        assert isinstance(partition, ShardBatch)
        hold = (self.fault.at, partition.shard, partition.batch) == ("read", self.fault.partition, self.fault.batch)
        half = len(partition.ids) // 2
        yielded = 0
        for chunk in arrow_batches(self.options, partition, self.chunk_rows):
            rest = chunk
            if hold and yielded + chunk.num_rows > half and _task()[1] == 0:
                first = half - yielded  # the rows before the half go first, then the task holds
                if first:
                    yield chunk.slice(0, first)
                self.fault.wait("read")
                hold = False
                rest = chunk.slice(first)
            yield rest
            yielded += chunk.num_rows


class FaultyOutbox(OutboxDataSource):
    """``format("outbox_faulty")``: the ``outbox`` source plus the fault options."""

    @classmethod
    def name(cls) -> str:
        """The format name."""
        return "outbox_faulty"

    def writer(self, schema: StructType, overwrite: bool) -> FaultyWriter:
        """The real batch writer, wrapped."""
        return FaultyWriter(super().writer(schema, overwrite), Fault.of(self.options))

    def streamWriter(self, schema: StructType, overwrite: bool) -> FaultyStreamWriter:  # noqa: N802
        """The real streaming writer, wrapped."""
        return FaultyStreamWriter(super().streamWriter(schema, overwrite), Fault.of(self.options))

    def streamReader(self, schema: StructType) -> FaultyStreamReader:  # noqa: N802
        """The real drain, holding a read when configured to."""
        return FaultyStreamReader(DrainOptions.parse(self.options), Fault.of(self.options))

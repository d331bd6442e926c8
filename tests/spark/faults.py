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
- ``faultDir``: a directory shared by driver and executors; each fault leaves a file there, which
  both proves it fired and makes a commit fault fire only once across query restarts.
"""

from __future__ import annotations

import time
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from pyspark import TaskContext
from pyspark.sql.datasource import WriterCommitMessage
from pyspark.sql.types import StructType

from harvester.spark import OutboxDataSource, OutboxStreamWriter, OutboxWriter, StagedPartition

# How long a held commit waits at most (so that a test gone wrong cannot hang a worker).
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
        """Stage as usual, then maybe fail."""
        message = super().write(iterator)
        self.fault.after_stage()
        return message


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

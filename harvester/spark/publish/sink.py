"""The ``outbox-publish`` Spark data source: a streaming sink for the rows of
``readStream.format("outbox")`` that publishes them as a reaper does and dead-letters what Kafka
refuses, so that a refused record never stalls the query.

- **Tasks** (``write``, on the executors): one per input partition, that is per shard, in id
  order; each publishes its records with the reaper's producer (:mod:`harvester.spark.publish.task`)
  and returns what Kafka refused after its attempts, with the shard's term to dead-letter them
  under (the ``term`` column; without it, the epoch in each record's headers).
- **Commit** (``commit``, on the driver, once every task succeeded): the refused records are moved
  to the dead-letter table under their shard's fence (:mod:`harvester.spark.publish.dead_letters`).
  The source's own commit then purges the batch: every record of it is either in Kafka or a dead
  letter.
- A task that fails (a retriable error the user's settings let surface, a lost executor) fails
  the attempt; Spark runs it again, and a batch that fails for good is replayed by the source.
"""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

from pyspark.sql.datasource import DataSource, DataSourceStreamArrowWriter, WriterCommitMessage
from pyspark.sql.types import StructType

from harvester.core.identity import IdentityHeaders
from harvester.core.records import Failure
from harvester.spark.options import DrainConfigError
from harvester.spark.publish.dead_letters import dead_letter
from harvester.spark.publish.options import PublishOptions
from harvester.spark.publish.task import Record, Refusal, publish

_COLUMNS = ("topic", "key", "value", "headers", "id")


@dataclass(frozen=True, slots=True)
class Published(WriterCommitMessage):
    """A task's outcome: how many records it delivered, and those Kafka refused for good."""

    delivered: int
    refused: tuple[Refusal, ...]


def _records(batches: Iterator[Any], terms: set[int]) -> Iterator[Record]:
    """The records of ``batches``; the terms of their ``term`` column, if any, go into ``terms``."""
    for batch in batches:
        if "term" in batch.schema.names:
            terms.update(batch.column("term").unique().to_pylist())
        # The headers come flat, in one list of pairs for the whole batch, each record's a slice of
        # it: converting the column whole builds a dict per header, most of the task's work.
        headers = batch.column("headers")
        at = headers.offsets.to_pylist()
        fields = headers.values
        if fields.null_count:  # the drain's headers never are; a user's transformed column might be
            raise ValueError("outbox-publish: a header in the headers column is null")
        pairs = list(zip(fields.field("key").to_pylist(), fields.field("value").to_pylist(), strict=True))
        rows = zip(*(batch.column(name).to_pylist() for name in ("id", *_COLUMNS[:3])), strict=True)
        for n, (rid, topic, key, value) in enumerate(rows):
            yield Record(rid, topic, key, value, pairs[at[n] : at[n + 1]])


class OutboxPublishWriter(DataSourceStreamArrowWriter):
    """Publishes each micro-batch's shards in parallel; the driver dead-letters what was refused."""

    def __init__(self, options: PublishOptions) -> None:
        self.options = options

    def write(self, iterator: Iterator[Any]) -> Published:
        """Publish this task's records (runs on an executor)."""
        epoch = IdentityHeaders(self.options.header_prefix).epoch
        terms: set[int] = set()
        outcome = publish(self.options.kafka, _records(iterator, terms), self.options.max_attempts, epoch)
        refused = outcome.refused
        if len(terms) == 1:
            # Dead-lettered under the term the shard's batch was handed out under: a batch replayed
            # after a restart carries the epoch it was planned under in its headers, a term gone.
            (term,) = terms
            refused = [Refusal(term, r.failure) for r in refused]
        return Published(outcome.records - len(refused), tuple(refused))

    def commit(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Dead-letter the refused records under their shards' fences."""
        by_epoch: dict[int, list[Failure]] = defaultdict(list)
        for message in messages:
            if isinstance(message, Published):
                for refusal in message.refused:
                    by_epoch[refusal.epoch].append(refusal.failure)
        for epoch, failures in sorted(by_epoch.items()):
            dead_letter(self.options.dsn, self.options.table, epoch, failures, batchId)

    def abort(self, messages: Sequence[WriterCommitMessage | None], batchId: int) -> None:  # noqa: N803
        """Nothing to undo: the batch is not committed, so the source replays it."""


class OutboxPublishDataSource(DataSource):
    """``writeStream.format("outbox-publish")``: the drain's rows into Kafka, as a reaper publishes
    them; see ``docs/spark.md``. Registered with :func:`harvester.spark.register`."""

    @classmethod
    def name(cls) -> str:
        """The format name: ``outbox-publish``."""
        return "outbox-publish"

    def streamWriter(self, schema: StructType, overwrite: bool) -> OutboxPublishWriter:  # noqa: N802
        """The sink; options and columns are checked here, before any task runs."""
        missing = [c for c in _COLUMNS if c not in schema.fieldNames()]
        if missing:
            raise DrainConfigError(
                f"outbox-publish needs the columns of readStream.format('outbox'); missing: {', '.join(missing)}"
            )
        return OutboxPublishWriter(PublishOptions.parse(self.options))

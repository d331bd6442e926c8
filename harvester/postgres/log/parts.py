"""The parts a log store is composed of, one protocol each; :func:`harvester.compose.log_store` is
the one place that picks them.

- :class:`Decoding`, how the stream's messages become records: the outbox table's inserts
  (:mod:`.decoding`), logical messages (:mod:`.messages`, the table-less outbox) or the inserts of a
  table of Debezium's layout (:mod:`.event_router_rows`).
- :class:`Finish`, how records done are made durable under the fence before the slot moves past
  them: a delete per batch (:mod:`.deletes`) or a stored position (:mod:`.position`, with or without
  a retention window's bulk delete, :mod:`.retention`).
- :class:`Rows`, whether the records are rows of the table too (:mod:`.rows`): then a dead letter
  moves its row, a new term skips the rows an earlier one deleted and a lost slot is recovered from
  the table; or not, and a dead letter's record is copied from memory.

A part calls the store it is bound to (:class:`Ledger`) once per batch, never per record.
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from typing import Any, Protocol
from uuid import UUID

import psycopg

from harvester.core.protocols import SourceSample
from harvester.core.records import Failure, MarkedRecord
from harvester.postgres.connections import Connections
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.log.slot import SlotStream
from harvester.postgres.log.spill import Budget
from harvester.postgres.log.streamed import ChangeDecoder, Received
from harvester.postgres.log.transactions import Taken, Transactions
from harvester.postgres.schema.catalog import OutboxColumns
from harvester.postgres.schema.fencing import Fence
from harvester.postgres.schema.identifiers import TableName


class Ledger(Protocol):
    """What a part reads and moves of the log store it is bound to. ``state`` guards ``txns`` and
    ``released``."""

    db: Connections
    fence: Fence
    table: TableName
    slot: SlotStream
    state: threading.Lock
    txns: Transactions
    released: set[int]

    def completed(self, ids: Sequence[int], *, follow: bool = True) -> int: ...

    def checkpointed(self, ids: Sequence[int], position: int) -> tuple[int, int, int]: ...

    def confirm(self, lsn: int) -> None: ...

    def receive(self, messages: list[Received]) -> None: ...

    def forget(self, ids: Sequence[int]) -> None: ...

    def delete_rows(self, ids: Sequence[int], position: int | None = None) -> None: ...

    def table_head(self) -> tuple[int, float | None]: ...

    def move_dead_letters(self, failures: Sequence[Failure], leader_id: UUID) -> None: ...


class Decoding(Protocol):
    """How the stream's messages become records, for one outbox layout."""

    @property
    def reads_table(self) -> bool:
        """Whether the records are the outbox table's inserts (the store looks its oid up)."""
        ...

    def columns(self, conn: psycopg.Connection[Any], table: TableName) -> OutboxColumns:
        """The outbox's shape, as :meth:`~harvester.postgres.table.store.PostgresStore.prepare` reads it."""
        ...

    def transactions(self, oid: int, budget: Budget) -> Transactions:
        """The bookkeeping of the stream's messages that are records (``oid``: the table's, or 0)."""
        ...

    def records(self, taken: Taken) -> list[MarkedRecord]:
        """The records of a batch taken from the buffer, before the identity headers."""
        ...

    def stream_decoder(self, oid: int) -> ChangeDecoder:
        """The decoder of one transaction streamed in progress (:mod:`.streamed`)."""
        ...


class Finish(Protocol):
    """How records done are made durable, under the fence, before the slot is confirmed past them."""

    def bind(self, ledger: Ledger) -> None: ...

    def acquired(self) -> None:
        """After the term's take-over of the slot."""
        ...

    def marked(self) -> None:
        """After each mark (mark thread)."""
        ...

    def purge(self, ids: Sequence[int]) -> None:
        """Delivered ``ids`` (no lost slot's recovery under way)."""
        ...

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Exactly once: delivered ``ids`` of the checkpoint ``position``."""
        ...

    def done(self, ids: Sequence[int], *, purged: bool = True) -> None:
        """After a fenced statement about ``ids`` succeeded (``purged``: delivered, not dead-lettered)."""
        ...

    def advance_to(self, lsn: int) -> None:
        """Everything received before ``lsn`` is done: confirm it."""
        ...

    def durable(self, ids: Sequence[int]) -> list[int]: ...

    def head(self) -> tuple[int, float | None]: ...

    def sample(self, sample: SourceSample, leads: bool) -> SourceSample: ...

    def before_harvest(self) -> None:
        """Before a lost slot's recovery reads the head of the table."""
        ...

    def close(self) -> None:
        """Before the store closes its stream and connections."""
        ...


class Rows(Protocol):
    """Whether the outbox's records are rows of its table too."""

    @property
    def recoverable(self) -> bool:
        """Whether a lost slot is recovered from the table's rows (:mod:`.recovery`)."""
        ...

    def bind(self, ledger: Ledger) -> None: ...

    def prepared(self, setup: LogSetup) -> None:
        """After each :meth:`~harvester.postgres.log.store.LogStore.prepare`."""
        ...

    def gone(self, taken: Taken, records: list[MarkedRecord], term_lsn: int) -> set[int]:
        """The ids of ``records`` an earlier term delivered and deleted (``term_lsn``: where this
        term began)."""
        ...

    def handed_out(self, records: list[MarkedRecord]) -> None:
        """``records`` go out (caller holds the ledger's ``state``)."""
        ...

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> bool:
        """Dead-letter ``failures`` (one fenced statement); whether they count as done now."""
        ...

    def forget(self, ids: Sequence[int]) -> None:
        """``ids`` are done (caller holds the ledger's ``state``)."""
        ...

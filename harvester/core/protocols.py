"""What the engine needs from its collaborators, one small protocol per role.

The engine core and its dispatchers depend only on these; PostgreSQL (:mod:`harvester.postgres`),
Kafka (:mod:`harvester.kafka`) and NELI (:mod:`leader`) live behind them, so the algorithm is
testable on its own and each adapter is replaceable. One store object usually plays every
store role; each part of the engine names only the roles it uses.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, runtime_checkable
from uuid import UUID

from harvester.core.records import Failure, MarkedRecord
from leader.events import LeaderEvent, LeaderStatus


class StoreError(Exception):
    """The database could not be reached or refused a statement; retry after a back-off."""


class StoreUnreachableError(StoreError):
    """The database path failed (no connection, a connection lost, or a statement timed out), as
    opposed to a statement the database refused; a leader that sees only these for longer than
    ``heartbeat_timeout`` yields (docs/reaper.md).

    ``since`` is the monotonic time the failed call began, when known: a statement that waited
    ``statementTimeout`` for an answer shows a path that has failed since it was sent."""

    def __init__(self, message: str, *, since: float | None = None) -> None:
        super().__init__(message)
        self.since = since


class FencedError(StoreError):
    """A newer leader bumped the fence epoch: this process must stop leader work, not retry."""


class FatalStoreError(StoreError):
    """The store cannot go on in this process, whatever a retry does: the engine stops leading and
    the harvester stops with this error's one line, which says what to do."""


class RefusedError(Exception):
    """Kafka refuses what this process needs to lead (an ACL it lacks): no retry succeeds until an
    operator grants it, so the engine stops leading and the harvester stops with this error's one
    line, which names the grant; the records stay in the outbox."""


class ShardCountError(FatalStoreError):
    """The configured number of shards is not the one the outbox's fence records: a configuration
    mistake (or a change of it under way), never retried."""


class MarkSource(Protocol):
    """The engine core's view of the outbox: terms under an epoch fence, and marking."""

    def acquire(self, leader_id: UUID) -> int:
        """Bump the fence epoch for a new leadership term; later statements run under it."""
        ...

    def mark(self, leader_id: UUID, limit: int) -> list[MarkedRecord]:
        """Mark up to ``limit`` records not marked by ``leader_id``; return them sorted by id.

        Raises :class:`FencedError` when the epoch was superseded."""
        ...

    def wait_for_insert(self, timeout: float) -> bool:
        """Block until new records may be available (True) or ``timeout`` passes (False)."""
        ...


class FailedRecords(Protocol):
    """Where failed deliveries go: back to the outbox, with an attempt counted, or dead-lettered."""

    @property
    def tracks_attempts(self) -> bool:
        """Whether attempt counts are kept in the table (else the engine keeps them in memory)."""
        ...

    def reset(self, ids: Sequence[int]) -> None:
        """Make records whose delivery failed eligible for the next mark again."""
        ...

    def fail(self, failures: Sequence[Failure]) -> None:
        """Unmark permanently failed records, counting the attempt (one statement)."""
        ...

    def dead_letter(self, failures: Sequence[Failure], leader_id: UUID) -> None:
        """Move records out of the outbox into the dead-letter table, in one transaction."""
        ...


class Purger(Protocol):
    """At-least-once completion: delivered records leave the outbox."""

    @property
    def release_on_ack(self) -> bool:
        """Whether a key's barrier may drop when Kafka acknowledges its record, before its purge
        commits (:func:`harvester.core.gate.release_at_ack` says what a crash repeats then)."""
        ...

    def purge(self, ids: Sequence[int]) -> None:
        """Delete delivered records (one statement for all ids)."""
        ...

    def durable(self, ids: Sequence[int]) -> list[int]:
        """Of purged ``ids``, and of those earlier calls did not return, those a new leader would
        not publish again: ``ids`` where a purge deletes them; where it stores a position instead,
        those the stored position covers (each returned once)."""
        ...


class CheckpointStore(Protocol):
    """Exactly-once completion: purges move together with the checkpoint position."""

    def checkpoint_position(self) -> int:
        """Where exactly-once recovery starts reading the checkpoint topic."""
        ...

    def purge_checkpointed(self, ids: Sequence[int], position: int) -> None:
        """Purge records of committed transactions and advance the checkpoint position, atomically."""
        ...


# A record and its delivery's error (None: Kafka acknowledged it). One argument, so that a queue's
# put_nowait can take the reports: the callback runs once per record.
DeliveryReport = tuple[MarkedRecord, Exception | None]
DeliveryCallback = Callable[[DeliveryReport], None]


class Publisher(Protocol):
    """Asynchronous publishing with one delivery report per record."""

    @property
    def keeps_order(self) -> bool:
        """Whether, of the records published to one partition, those written are always the first
        ones in publish order, and none of them fails but with all after it: then several records of
        a key may be in flight at once without reordering it."""
        ...

    def publish(self, records: Sequence[MarkedRecord]) -> None:
        """Enqueue ``records``, in order; each one's delivery report reaches the callback given at
        construction (a record refused at once too). Raises only before enqueuing any of them:
        :class:`RefusedError` once the producer failed for good."""
        ...

    def begin_term(self) -> None:
        """A leadership term begins: everything not done is published again, in order."""
        ...

    def close(self, timeout: float) -> None:
        """Flush outstanding records (bounded by ``timeout``) and release the client."""
        ...


PublisherFactory = Callable[[DeliveryCallback], Publisher]

# Wraps the dispatch of each marked batch (the OpenTelemetry adapter's publish span, for one).
BatchScope = Callable[[Sequence[MarkedRecord]], AbstractContextManager[object]]


class ProducerFencedError(Exception):
    """A newer leader initialised the shared transactional id: this process is a zombie."""


class TransactionAbortedError(Exception):
    """The transaction failed and was aborted; its records stay in the outbox."""

    def __init__(self, message: str, failures: dict[int, Exception]) -> None:
        super().__init__(message)
        self.failures = failures  # per-record delivery errors, when Kafka named the culprits


class TransactionalPublisher(Protocol):
    """Exactly-once publishing: a batch and its checkpoint commit in one transaction."""

    def init(self) -> None:
        """Initialise transactions for a new term, fencing the previous leader's producer.

        Raises :class:`RefusedError` when Kafka refuses the transactional id (a missing ACL)."""
        ...

    def publish_batch(self, records: Sequence[MarkedRecord], epoch: int) -> int:
        """Publish and commit; return the checkpoint position after this batch.

        Raises :class:`TransactionAbortedError` or :class:`ProducerFencedError`."""
        ...

    def recover(self, position: int) -> tuple[list[int], int]:
        """Outbox ids of committed checkpoints from ``position`` on, and the end position."""
        ...

    def close(self, timeout: float) -> None:
        """Release the producer."""
        ...


class Elector(Protocol):
    """Decides whether this process leads."""

    def start(self, on_event: Callable[[LeaderEvent], None]) -> None:
        """Begin competing for leadership; events reach ``on_event`` on the elector's thread."""
        ...

    def close(self, timeout: float | None = None) -> None:
        """Leave the group (emitting ``LeaderRevoked`` first when leader) so a standby takes over;
        waits at most ``timeout`` seconds (None: until it left), then leaves in the background."""
        ...

    @property
    def status(self) -> LeaderStatus:
        """The current view of leadership."""
        ...

    @property
    def running(self) -> bool:
        """Whether the elector is competing (after ``start``, before ``close``)."""
        ...


@runtime_checkable
class ShardedElector(Elector, Protocol):
    """An elector of several shards (NELI over a topic of several partitions)."""

    def status_of(self, shard: int) -> LeaderStatus:
        """The view of shard ``shard``'s leadership."""
        ...


class Backlog(Protocol):
    """What the meter samples of every store."""

    def head(self) -> tuple[int, float | None]:
        """A cheap backlog sample: (records, age in seconds of the oldest; None: no record)."""
        ...


@dataclass(frozen=True, slots=True)
class SourceSample:
    """One sample of a source's backlog and lag, as the meter exports it."""

    backlog: int
    oldest_age: float | None  # seconds (None: no record)
    lag: float  # seconds: the oldest record committed and not yet acknowledged by Kafka
    slot_bytes: tuple[int, int] | None = None  # a replication slot's WAL (not consumed, retained)


class SourceGauges(Protocol):
    """Optional store role: a source that knows more of its backlog and lag than its :meth:`Backlog.head`
    (the log source: what its leader received and has not done, its replication slot). The meter
    samples a store that has it through it; any other through its head."""

    def sample(self, leads: bool) -> SourceSample:
        """The sample; ``leads``: whether this process leads (what a former leader received is stale).
        Raises :class:`StoreError` when the database cannot be read (a standby's probe fails so)."""
        ...

"""Message identity: the headers every published record carries, so readers can drop re-deliveries.

A record is identified by (producer, outbox id). The producer name is stable across restarts and
failovers of the harvester group (default: the database's system identifier and the table name);
the epoch tells which leadership term published it. The Spark drain, which publishes many records
of a key at once, adds where a record stands in its micro-batch (``batch``, ``previous``), so that
a reader can drop a replayed batch's copies (:mod:`harvester.client.dedup`).
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "outbox-"

KEY_RUN = 8
"""How many records of a key a log-source leader may have sent and not purged at once, in flight or
acknowledged (:func:`harvester.core.gate.release_at_ack`): a crash repeats at most this many, in order.
:class:`harvester.client.dedup.DedupReader` remembers as many ids per key and term by default."""


@dataclass(frozen=True, slots=True)
class IdentityHeaders:
    """Header names, all starting with a configurable prefix so they never clash with the row's own
    headers: ``<prefix>id`` (outbox id, decimal), ``<prefix>epoch`` (fence epoch, decimal) and
    ``<prefix>producer`` (producer name); from the Spark drain also ``<prefix>batch`` (the shard's
    micro-batch number) and ``<prefix>previous`` (the id of the key's record before this one in
    that batch, absent for the key's first)."""

    prefix: str = DEFAULT_PREFIX

    @property
    def id(self) -> str:
        """Header carrying the record's outbox id."""
        return f"{self.prefix}id"

    @property
    def epoch(self) -> str:
        """Header carrying the epoch of the leader that published the record."""
        return f"{self.prefix}epoch"

    @property
    def producer(self) -> str:
        """Header carrying the stable producer name."""
        return f"{self.prefix}producer"

    @property
    def batch(self) -> str:
        """Header carrying the Spark drain's micro-batch number (of the record's shard)."""
        return f"{self.prefix}batch"

    @property
    def previous(self) -> str:
        """Header carrying the id of the key's record before this one in the same micro-batch."""
        return f"{self.prefix}previous"


@dataclass(frozen=True, slots=True)
class Stamp:
    """The identity headers of one term's records, built once per mark and carried by each record
    (:attr:`harvester.core.records.MarkedRecord.stamp`). A record's headers are joined only where
    it is produced: in the producer process when there is one, since building three header pairs per
    record in the harvester and pickling them to the child cost its interpreter, which bounds the
    log source's drain, about a twentieth of its time."""

    id: str  # the id header's name; the value is the record's id
    epoch: tuple[str, bytes]
    producer: tuple[str, bytes]

    @classmethod
    def of(cls, names: IdentityHeaders, epoch: int, producer: bytes) -> Stamp:
        """The stamp of term ``epoch``'s records, ``producer`` being the producer name's UTF-8."""
        return cls(names.id, (names.epoch, str(epoch).encode()), (names.producer, producer))

    def headers(self, record_id: int) -> list[tuple[str, bytes]]:
        """The identity headers of record ``record_id``, to follow its own."""
        return [(self.id, str(record_id).encode()), self.epoch, self.producer]


@dataclass(frozen=True, slots=True)
class Identity:
    """A published record's identity, as read back from its headers."""

    producer: str
    id: int
    epoch: int
    batch: int | None = None  # the Spark drain's micro-batch; None from a reaper
    previous: int | None = None  # the key's record before this one in that batch

    @classmethod
    def from_headers(
        cls, headers: list[tuple[str, bytes | None]] | None, names: IdentityHeaders = IdentityHeaders()
    ) -> Identity | None:
        """Read the identity headers; None when the message does not carry them."""
        found: dict[str, bytes] = {}
        for k, v in headers or ():
            if v is not None and k in (names.id, names.epoch, names.producer, names.batch, names.previous):
                found[k] = v
        try:
            batch = int(found[names.batch]) if names.batch in found else None
            previous = int(found[names.previous]) if batch is not None and names.previous in found else None
            return cls(found[names.producer].decode(), int(found[names.id]), int(found[names.epoch]), batch, previous)
        except (KeyError, ValueError, UnicodeDecodeError):
            return None

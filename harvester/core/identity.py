"""Message identity: the headers every published record carries, so readers can drop re-deliveries.

A record is identified by (producer, outbox id). The producer name is stable across restarts and
failovers of the harvester group (default: the database's system identifier and the table name);
the epoch tells which leadership term published it.
"""

from __future__ import annotations

from dataclasses import dataclass

DEFAULT_PREFIX = "outbox-"


@dataclass(frozen=True, slots=True)
class IdentityHeaders:
    """Header names, all starting with a configurable prefix so they never clash with the row's own
    headers: ``<prefix>id`` (outbox id, decimal), ``<prefix>epoch`` (fence epoch, decimal) and
    ``<prefix>producer`` (producer name)."""

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


@dataclass(frozen=True, slots=True)
class Identity:
    """A published record's identity, as read back from its headers."""

    producer: str
    id: int
    epoch: int

    @classmethod
    def from_headers(
        cls, headers: list[tuple[str, bytes | None]] | None, names: IdentityHeaders = IdentityHeaders()
    ) -> Identity | None:
        """Read the identity headers; None when the message does not carry them."""
        found: dict[str, bytes] = {}
        for k, v in headers or ():
            if v is not None and k in (names.id, names.epoch, names.producer):
                found[k] = v
        try:
            return cls(found[names.producer].decode(), int(found[names.id]), int(found[names.epoch]))
        except (KeyError, ValueError, UnicodeDecodeError):
            return None

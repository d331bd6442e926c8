"""What a leader has marked, kept in its memory rather than in the outbox's rows.

goharvest writes the leader id into every row it marks, and its next mark takes the rows that do
not carry it: one more row version per record. The store keeps the same fact here instead: the
ids handed out under the current leader id and not yet settled. A new leader, or a refreshed
leader id, starts with nothing handed out, so everything unacknowledged is marked again in id
order (goharvest's unimodal recovery).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from uuid import UUID


class HandedOut:
    """The ids marked under one leader id and not yet settled (purged, reset, failed or
    dead-lettered). The mark thread adds, the completion thread removes."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leader_id: UUID | None = None
        self._ids: set[int] = set()

    def exclude(self, leader_id: UUID) -> list[int]:
        """The ids the next mark under ``leader_id`` must skip; a new leader id skips none."""
        with self._lock:
            if leader_id != self._leader_id:
                self._leader_id, self._ids = leader_id, set()
            return list(self._ids)

    def add(self, leader_id: UUID, ids: Sequence[int]) -> None:
        """``ids`` were marked under ``leader_id`` (ignored if the id was refreshed meanwhile)."""
        with self._lock:
            if leader_id == self._leader_id:
                self._ids.update(ids)

    def settled(self, ids: Sequence[int]) -> None:
        """Called after the statement that settled ``ids`` committed: a mark running meanwhile
        still skips them (its snapshot may predate the purge)."""
        with self._lock:
            self._ids.difference_update(ids)

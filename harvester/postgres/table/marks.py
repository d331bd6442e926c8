"""What a leader has marked, kept in its memory rather than in the outbox's rows.

goharvest writes the leader id into every row it marks, and its next mark takes the rows that do
not carry it: one more row version per record. The store keeps the same fact here instead: the
ids handed out under the current leader id and not yet settled, and the frontier before which every
row is handed out or never will be visible (:mod:`harvester.postgres.table.frontier`). A new leader,
or a refreshed leader id, starts with nothing handed out, so everything unacknowledged is marked
again in id order (goharvest's unimodal recovery).
"""

from __future__ import annotations

import threading
from collections.abc import Sequence
from dataclasses import dataclass
from uuid import UUID

FIRST_ID = -(2**63)  # a bigint's least: marks look from there without a frontier


@dataclass(frozen=True, slots=True)
class Exclusion:
    """What the next mark skips: every id before ``start``, and ``ids`` from it on."""

    start: int
    ids: list[int]
    releases: int  # how many releases had happened: a frontier found past one is not trusted


class HandedOut:
    """The ids marked under one leader id and not yet settled (purged, reset, failed or
    dead-lettered), and the frontier. The mark thread adds and advances, the completion thread
    settles and releases."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._leader_id: UUID | None = None
        self._ids: set[int] = set()
        self._start = FIRST_ID
        self._releases = 0

    def exclude(self, leader_id: UUID, *, sweep: bool = False) -> Exclusion:
        """What the next mark under ``leader_id`` must skip; a new leader id skips nothing. A
        ``sweep`` looks from the start, skipping every id handed out."""
        with self._lock:
            if leader_id != self._leader_id:
                self._leader_id, self._ids, self._start = leader_id, set(), FIRST_ID
            start = FIRST_ID if sweep else self._start
            ids = [i for i in self._ids if i >= start] if start > FIRST_ID else list(self._ids)
            return Exclusion(start, ids, self._releases)

    def add(self, leader_id: UUID, ids: Sequence[int]) -> None:
        """``ids`` were marked under ``leader_id`` (ignored if the id was refreshed meanwhile)."""
        with self._lock:
            if leader_id == self._leader_id:
                self._ids.update(ids)

    def advance(self, leader_id: UUID, before: Exclusion, start: int) -> None:
        """Every row before ``start`` is handed out or never will be visible, as a mark that
        skipped ``before`` found: the frontier moves there, unless ids were released meanwhile
        (the mark may have skipped them) or the leader id changed."""
        with self._lock:
            if leader_id == self._leader_id and before.releases == self._releases:
                self._start = max(self._start, start)

    @property
    def start(self) -> int:
        """The frontier: the first id marks look at (:data:`FIRST_ID` without a frontier)."""
        with self._lock:
            return self._start

    def settled(self, ids: Sequence[int]) -> None:
        """Called after the statement that deleted ``ids`` committed: a mark running meanwhile
        still skips them (its snapshot may predate the purge)."""
        with self._lock:
            self._ids.difference_update(ids)

    def released(self, ids: Sequence[int]) -> None:
        """``ids`` are eligible for the next mark again (a reset or a failure): the frontier falls
        back below them."""
        if not ids:
            return
        with self._lock:
            self._ids.difference_update(ids)
            self._start = min(self._start, *ids)
            self._releases += 1

"""Purges off the keys' round trip, for a gate whose keys may send before their records' purges
(:attr:`~harvester.core.gate.ReleasePolicy.releases_at_ack`): acknowledged batches are purged on a
thread of their own, one after another in acknowledgement order, gathered into larger statements.
"""

from __future__ import annotations

import queue
import time
from collections.abc import Callable, Mapping

from harvester.core.dispatch import worker
from harvester.core.protocols import DeliveryReport

# Acknowledged batches one purge takes at most (records), when several wait.
_PURGE_BATCH = 20_000
# A purge of fewer records waits this long for more: off the keys' round trip, a purge mostly frees
# memory and moves the slot, so at a steady rate (acknowledgements every few milliseconds) fewer,
# larger statements cost PostgreSQL less per record.
_PURGE_GATHER = 1_000
_PURGE_GATHER_SECONDS = 0.05
# How often held records are looked at again while no purge comes.
_HELD_RECHECK_SECONDS = 0.5


class PurgeThread:
    """Runs ``finish`` on the answered batches put to it, gathered, in order; while ``holding()`` (purged
    records wait for the store's position), runs it on no records every so often: the position may
    come to cover them without a purge of this thread (the mark thread stores it when a completion's
    confirmation failed)."""

    def __init__(
        self,
        finish: Callable[[list[DeliveryReport]], None],
        holding: Callable[[], bool],
        labels: Mapping[str, object],
    ) -> None:
        self._finish = finish
        self._holding = holding
        # Answered batches; None tells the thread to exit.
        self._batches: queue.SimpleQueue[list[DeliveryReport] | None] = queue.SimpleQueue()
        self.thread = worker(self._loop, "harvester-purge", labels)

    def put(self, items: list[DeliveryReport]) -> None:
        """Purge ``items`` after the batches put before them."""
        self._batches.put_nowait(items)

    def close(self) -> None:
        """Exit once the batches put so far are purged."""
        self._batches.put_nowait(None)

    def _loop(self) -> None:
        batches = self._batches
        while True:
            try:
                first = batches.get(timeout=_HELD_RECHECK_SECONDS if self._holding() else None)
            except queue.Empty:
                self._finish([])
                continue
            if first is None:
                return
            items = list(first)
            gather_until = time.monotonic() + _PURGE_GATHER_SECONDS
            while len(items) < _PURGE_BATCH:
                left = gather_until - time.monotonic() if len(items) < _PURGE_GATHER else 0.0
                try:
                    more = batches.get(timeout=left) if left > 0 else batches.get_nowait()
                except queue.Empty:
                    break
                if more is None:
                    batches.put_nowait(None)
                    break
                items += more
            self._finish(items)

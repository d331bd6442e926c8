"""Harvesters built for a test: a factory that stops them at the end, and an elector the test drives
by hand."""

from __future__ import annotations

import uuid
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from typing import TYPE_CHECKING, Any

if TYPE_CHECKING:
    from harvester import Harvester, HarvesterConfig
    from harvester.core.protocols import Elector

HarvesterFactory = Callable[..., "Harvester"]


class ManualElector:
    """An elector the test drives by hand (leadership is not what these tests are about; the NELI
    elector has tests of its own, and the end-to-end tests use it)."""

    def __init__(self, leader: bool = True) -> None:
        from leader.events import LeaderStatus

        self._status_type = LeaderStatus
        self._leader = leader
        self._leader_id: uuid.UUID | None = None
        self._on_event: Any = None

    def start(self, on_event: Any) -> None:
        self._on_event = on_event
        if self._leader:
            self.acquire()

    def acquire(self) -> uuid.UUID:
        from leader.events import LeaderAcquired

        self._leader_id = uuid.uuid4()
        self._on_event(LeaderAcquired(self._leader_id))
        return self._leader_id

    def fence(self) -> None:
        from leader.events import LeaderFenced

        assert self._leader_id is not None
        leader_id, self._leader_id = self._leader_id, None
        self._on_event(LeaderFenced(leader_id))

    def close(self, timeout: float | None = None) -> None:
        from leader.events import LeaderRevoked

        if self._leader_id is not None:
            leader_id, self._leader_id = self._leader_id, None
            self._on_event(LeaderRevoked(leader_id))

    @property
    def status(self) -> Any:
        return self._status_type(self._leader_id is not None, self._leader_id, None)

    @property
    def running(self) -> bool:
        return self._on_event is not None


@contextmanager
def harvesters(config_of: Callable[..., HarvesterConfig]) -> Iterator[HarvesterFactory]:
    """A fixture's harvester factory: each harvester is built from ``config_of(**options)`` with a
    :class:`ManualElector` unless given an elector, started unless ``start=False``, and stopped when
    the block ends."""
    from harvester import Harvester

    made: list[Harvester] = []

    def make(*, elector: Elector | None = None, start: bool = True, **options: Any) -> Harvester:
        h = Harvester(config_of(**options), elector=elector if elector is not None else ManualElector())
        made.append(h)
        if start:
            h.start()
        return h

    yield make
    for h in made:
        h.stop(timeout=5)

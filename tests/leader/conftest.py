"""Fixtures for leader election tests: groups of competing ``python -m examples.leader_demo`` processes."""

from __future__ import annotations

from collections.abc import Callable, Iterator

import pytest

from examples.leader_demo import Competitor, DemoSettings
from tests.support.kafka import delete_topics
from tests.support.names import unique
from tests.support.services import Services

Spawn = Callable[..., list[Competitor]]


@pytest.fixture
def spawn(services: Services) -> Iterator[Spawn]:
    """Factory: ``spawn(n, settings=..., bootstrap=...)`` starts ``n`` competitors in a fresh group.

    All processes are stopped and the leader topics deleted afterwards.
    """
    started: list[Competitor] = []
    topics: dict[str, list[str]] = {}

    def make(n: int, settings: DemoSettings | None = None, bootstrap: str | None = None) -> list[Competitor]:
        server = bootstrap or services.bootstrap
        group = unique("neli")
        topics.setdefault(server, []).append(f"{group}.neli")
        made = [Competitor(server, group, settings or DemoSettings()) for _ in range(n)]
        started.extend(made)
        return made

    yield make
    for c in started:
        c.stop()
    for server, names in topics.items():
        delete_topics(server, names)

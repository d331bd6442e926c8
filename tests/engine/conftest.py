"""Fixtures for engine tests: a harvester factory over the test's outbox."""

from __future__ import annotations

from collections.abc import Callable, Iterator
from typing import Any

import pytest

from harvester import Harvester, HarvesterConfig, Limits
from harvester.identifiers import TableName
from harvester.protocols import Elector
from tests.support import ManualElector, Services

HarvesterFactory = Callable[..., Harvester]


@pytest.fixture
def make_harvester(services: Services, outbox: TableName) -> Iterator[HarvesterFactory]:
    """Build (and afterwards stop) harvesters on this test's outbox; keyword args tune limits."""
    made: list[Harvester] = []

    def make(
        *,
        elector: Elector | None = None,
        bootstrap: str | None = None,
        producer: dict[str, Any] | None = None,
        start: bool = True,
        **limits: Any,
    ) -> Harvester:
        config = HarvesterConfig(
            data_source=services.pg_dsn,
            outbox_table=outbox.qualified,
            base_kafka_config={"bootstrap.servers": bootstrap or services.bootstrap},
            producer_kafka_config=producer or {},
            limits=Limits(**{"io_error_backoff": "100ms", **limits}),
        )
        h = Harvester(config, elector=elector if elector is not None else ManualElector())
        made.append(h)
        if start:
            h.start()
        return h

    yield make
    for h in made:
        h.stop(timeout=5)

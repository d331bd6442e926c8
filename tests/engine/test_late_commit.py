"""A transaction that commits after records with higher ids were harvested is still harvested.

Ids come from the sequence at insert, not at commit: a relay that remembers "the highest id seen"
loses such rows, the classic flaw of polling relays. Mark-purge/reset marks every unmarked row,
whatever its id, so the late rows go out too, in id order within their key."""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import psycopg
import pytest

from harvester import OutboxRecord, Stasher
from harvester.postgres.identifiers import TableName
from tests.engine.workload import check, insert, wait_drained, wait_until
from tests.support import HarvesterFactory, Services, read_messages

pytestmark = pytest.mark.integration

# Consumer configuration, passed as read_messages(..., **COMMITTED).
COMMITTED: dict[str, Any] = {"isolation.level": "read_committed"}


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_rows_of_a_transaction_that_commits_late_are_harvested(
    services: Services,
    outbox: TableName,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
    delivery: str,
) -> None:
    topic = topics()
    with psycopg.connect(services.pg_dsn) as late:
        # The late transaction takes the lower ids first and stays open ...
        Stasher(outbox).stash(late, [OutboxRecord(topic=topic, key="late", value=f"late:{i}") for i in range(3)])
        h = make_harvester(settings={"delivery": delivery})
        # ... while later transactions, with higher ids, commit and are harvested.
        insert(services.pg_dsn, outbox, [(topic, "early", f"early:{i}") for i in range(3)])
        assert len(read_messages(services.bootstrap, [topic], 3, **COMMITTED)) == 3
        assert wait_until(lambda: h.metrics.purged._value.get() >= 3)
        late.commit()
    assert wait_drained(services.pg_dsn, outbox) == 0
    messages = read_messages(services.bootstrap, [topic], 6, **COMMITTED)
    verdict = check(messages, {"early": 3, "late": 3})
    assert verdict.lost == [] and verdict.out_of_order == []

"""A poison record does not take its neighbours with it: Kafka refuses a partition's whole batch for
one record too large, and the records that shared the batch are retried alone before any of them
counts as refused, so only the poison reaches the dead-letter table."""

from __future__ import annotations

import os
from collections.abc import Callable

import pytest

from harvester.postgres.schema.identifiers import TableName
from tests.deadletter.test_poison import FAST, dead_letters, raw_insert
from tests.engine.workload import wait_drained
from tests.log.test_log_source import COMMITTED, DELIVERY
from tests.support.harvesters import HarvesterFactory
from tests.support.kafka import read_messages, text
from tests.support.services import Services

pytestmark = pytest.mark.integration


@DELIVERY
def test_a_poison_record_dead_letters_none_of_the_records_that_shared_its_batch(
    services: Services,
    outbox: TableName,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
    delivery: str,
) -> None:
    small = topics(**{"max.message.bytes": "1024"})  # one partition: every record in one batch
    big = "p:0:" + os.urandom(2000).hex()  # larger than the topic takes, compressed too
    neighbours = [(small, "q", "q:0"), (small, "p", "p:1"), (small, "r", "r:0"), (small, "q", "q:1")]
    # Marked together before the harvester starts: exactly once, one transaction; at least once, the
    # records of other keys go out together (within linger.ms), the poison's key's next one after it.
    ids = raw_insert(services.pg_dsn, outbox, [(t, k, v, [], []) for t, k, v in [(small, "p", big), *neighbours]])
    make_harvester(
        producer=FAST,
        settings={"delivery": delivery},
        max_attempts=2,
        retry_backoff="10ms",
        max_retry_backoff="50ms",
    )
    assert wait_drained(services.pg_dsn, outbox) == 0
    assert dead_letters(services.pg_dsn, outbox) == {ids[0]: ("msg_size_too_large", 2)}
    got = [text(m.value()) for m in read_messages(services.bootstrap, [small], len(neighbours), **COMMITTED)]
    assert sorted(got) == sorted(v for _, _, v in neighbours)  # each once
    assert [v for v in got if v.startswith("q")] == ["q:0", "q:1"]  # in its key's order

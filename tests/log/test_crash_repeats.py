"""What a crash repeats with the log source, at least once: at most KEY_RUN records of each key, in
order, whether the purge deletes rows or stores a position (a retention window, a table-less
outbox); so DedupReader, which remembers that many ids per key and term, drops every repeat.

The burst is one large transaction, the case where a stored position used to move only at the
transaction's end, so that a crash repeated everything done of it: hundreds of records of each key."""

from __future__ import annotations

from collections import Counter
from collections.abc import Callable

import pytest

from harvester.core.identity import KEY_RUN, IdentityHeaders
from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check, insert, wait_until
from tests.log.conftest import SINGLE_SERVER, stash
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.kafka import consumed_headers, end_offsets, read_distinct
from tests.support.names import unique
from tests.support.services import Services

pytestmark = [pytest.mark.integration, pytest.mark.slow]

KEYS, PER_KEY, PARTITIONS = 20, 600, 3


@pytest.mark.parametrize("mode", ["per-batch-delete", "retention", "table-less"])
def test_a_crash_repeats_at_most_a_run_of_each_key(
    request: pytest.FixtureRequest, services: Services, logical_dsn: str, topics: Callable[..., str], mode: str
) -> None:
    table: TableName = request.getfixturevalue("message_outbox" if mode == "table-less" else "log_outbox")
    topic, group, total = topics(partitions=PARTITIONS), unique("repeats"), KEYS * PER_KEY
    rows = [(topic, f"k{i % KEYS}", f"k{i % KEYS}:{i // KEYS}") for i in range(total)]
    (stash if mode == "table-less" else insert)(logical_dsn, table, rows)
    settings: dict[str, dict[str, object]] = {
        "per-batch-delete": {},
        "retention": {"log_retention": "10m"},
        "table-less": {"log_messages": True, **SINGLE_SERVER},
    }

    def spec(name: str) -> dict[str, object]:
        limits = {"mark_query_records": 50, "max_in_flight_records": 200}
        return harvester_spec(
            logical_dsn, services.bootstrap, table, group, name, source="log", limits=limits, **settings[mode]
        )

    a = HarvesterProcess(spec("crashed-a"))
    b = None
    try:
        assert a.wait_for("LeaderAcquired"), a.log
        assert wait_until(lambda: end_offsets(services.bootstrap, topic, PARTITIONS) >= total // 3, timeout=60)
        a.proc.kill()
        published = end_offsets(services.bootstrap, topic, PARTITIONS)
        assert published < total, "the crash must come in the middle of the transaction"
        b = HarvesterProcess(spec("next-b"))
        assert b.wait_for("LeaderAcquired", timeout=60), b.log
        messages = read_distinct(services.bootstrap, topic, total)
    finally:
        for p in (a, b):
            if p is not None:
                p.terminate()
    verdict = check(messages, {f"k{i}": PER_KEY for i in range(KEYS)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    id_header = IdentityHeaders().id
    copies = Counter((m.key(), dict(consumed_headers(m) or [])[id_header]) for m in messages)
    repeated = Counter(key for (key, _), n in copies.items() if n > 1)
    assert max(repeated.values(), default=0) <= KEY_RUN, repeated

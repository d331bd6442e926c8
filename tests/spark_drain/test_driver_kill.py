"""The drain's driver killed mid-run (SIGKILL of the whole driver: Python, its JVM and the source's
Python runner) and restarted from the checkpoint: nothing lost, per-key order, and the only
duplicates are records of the batch that was unfinished when it died, none of which passes the
de-duplicating reader. Both drivers publish through ``outbox-publish``, whose tasks need no JVM
package: the killed driver's JVM starts without resolving Spark's Kafka connector. The restart runs
in the tests' own Spark session, which the other drain tests have started already: one JVM start
fewer."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest

from harvester.core.identity import Identity
from harvester.postgres.schema.identifiers import TableName
from harvester.spark.drain.offsets import planned_ids
from tests.engine.workload import wait_until
from tests.spark_drain.conftest import Drain, deduplicated, preload, remaining
from tests.support.kafka import consumed_headers, end_offsets, read_messages, text
from tests.support.paths import ROOT
from tests.support.services import Services

pytestmark = pytest.mark.integration

# Killed once two batches are purged: the unfinished batch is the third or a later one, of BATCH
# records over 30 keys (several per key, which the reader must drop as copies).
RECORDS, BATCH = 1000, 100


def drain_job(spec: dict[str, Any]) -> subprocess.Popen[str]:
    """A driver process of its own, in a session of its own so that it can be killed whole; its
    scratch space beside its checkpoint, not in /tmp where a killed driver would leave it."""
    scratch = Path(spec["checkpoint"]).parent / "scratch"
    return subprocess.Popen(
        [sys.executable, "-m", "tests.spark_drain.drain_job", json.dumps(spec)],
        cwd=ROOT,
        env={**os.environ, "SPARK_LOCAL_DIRS": str(scratch)},
        stdout=subprocess.PIPE,
        stderr=subprocess.STDOUT,
        text=True,
        start_new_session=True,
    )


def unfinished(checkpoint: Path) -> list[int]:
    """The ids of the batch the checkpoint's offset log planned and its commit log does not have."""
    planned = {int(p.name) for p in (checkpoint / "offsets").iterdir() if p.name.isdigit()}
    done = {int(p.name) for p in (checkpoint / "commits").iterdir() if p.name.isdigit()}
    left = sorted(planned - done)
    assert len(left) <= 1
    if not left:
        return []
    offset = json.loads((checkpoint / "offsets" / str(left[0])).read_text().splitlines()[2])
    return sorted(i for shard, part in offset.items() if shard.isdigit() for i in planned_ids(part))


@pytest.mark.timeout(600)  # a driver of its own, starting a JVM
def test_a_killed_driver_restarted_from_its_checkpoint_repeats_only_the_unfinished_batch(
    services: Services,
    pg: psycopg.Connection[Any],
    outbox: TableName,
    topics: Callable[..., str],
    drained: Drain,
    tmp_path: Path,
) -> None:
    topic = topics(partitions=2)
    ids = preload(pg, outbox, topic, RECORDS, keys=30)
    spec = {
        "dsn": services.pg_dsn,
        "table": outbox.qualified,
        "shards": 2,
        "max_records": BATCH,
        "bootstrap": services.bootstrap,
        "checkpoint": str(tmp_path / "cp"),
    }
    first = drain_job(spec)
    try:
        # Mid-run: some batches purged, most of the outbox left.
        mid_run = wait_until(
            lambda: len(remaining(pg, outbox)) <= len(ids) - 2 * BATCH or first.poll() is not None, 300
        )
        alive = first.poll() is None
    finally:
        os.killpg(first.pid, signal.SIGKILL)
        output = first.communicate()[0]
    assert mid_run and alive, output[-3000:]
    repeated = unfinished(tmp_path / "cp")
    assert remaining(pg, outbox)  # killed before the end

    # One batch after the replay: it only shortens the drain of the rest.
    (
        drained(shards="2", maxRecordsPerTrigger=str(RECORDS))
        .writeStream.format("outbox-publish")
        .options(dsn=services.pg_dsn, table=outbox.qualified, checkpointLocation=str(tmp_path / "cp"))
        .option("kafka.bootstrap.servers", services.bootstrap)
        .trigger(availableNow=True)
        .start()
        .awaitTermination()
    )
    assert remaining(pg, outbox) == []

    total = end_offsets(services.bootstrap, topic, partitions=2)
    messages = read_messages(services.bootstrap, [topic], total)
    by_key: dict[str, list[int]] = defaultdict(list)
    for msg in messages:
        identity = Identity.from_headers(consumed_headers(msg))
        assert identity is not None
        by_key[text(msg.key())].append(identity.id)
    every = [i for got in by_key.values() for i in got]
    assert sorted(set(every)) == ids  # none lost
    twice = {i for i, n in Counter(every).items() if n > 1}
    assert twice <= set(repeated)  # duplicates: only records of the unfinished batch
    for got in by_key.values():
        firsts = list(dict.fromkeys(got))
        assert firsts == sorted(firsts)  # per-key order, across the kill and the restart
    assert sorted(deduplicated(services, topic, partitions=2)) == ids  # none twice through the reader

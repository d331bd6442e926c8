"""A drain whose tasks publish what they read (``option("publish", "true")``,
harvester/spark/drain/task.py), on the local Spark session against the real broker, whose brokers
do not create topics: a third of the keys go to a topic that does not exist. The rest arrive in
per-key order, once through the de-duplicating reader; the refused records are dead letters with
the broker's reason; nothing is left in the outbox; the query's rows say what each task did. Each
shard's keys are split between two tasks (``tasksPerShard``), which keeps every key's records in one
task, in order."""

from __future__ import annotations

from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table
from tests.spark_drain.conftest import Drain, deduplicated, preload_a_third_missing, remaining
from tests.support.kafka import read_messages, text
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

RECORDS = 300


def test_tasks_publish_what_they_read_and_dead_letter_what_kafka_refuses(
    services: Services,
    pg: psycopg.Connection[Any],
    outbox: TableName,
    topics: Callable[..., str],
    drained: Drain,
    tmp_path: Path,
) -> None:
    good, missing = topics(partitions=2), unique("missing")
    refused = preload_a_third_missing(pg, outbox, good, missing, RECORDS)  # every record of keys k0, k3, ...
    stream = drained(
        shards="2",
        publish="true",
        maxAttempts="2",
        maxRecordsPerTrigger="100",  # several batches
        tasksPerShard="2",  # each shard's keys split between two tasks
        **{"kafka.bootstrap.servers": services.bootstrap, "kafka.topic.metadata.propagation.max.ms": "1000"},
    )
    assert stream.columns == ["shard", "batch", "term", "records", "dead_lettered"]
    query = (
        stream.writeStream.format("memory")  # any sink: the rows only say what the tasks did
        .queryName(unique("published").replace("-", "_"))
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(180)
    assert query.exception() is None
    done = stream.sparkSession.table(query.name).collect()

    assert remaining(pg, outbox) == []
    letters = pg.execute(
        sql.SQL("SELECT id, reason, error, attempts FROM {} ORDER BY id").format(dead_letter_table(outbox).ident)
    ).fetchall()
    assert [int(str(r[0])) for r in letters] == refused
    assert {r[3] for r in letters} == {2}  # after maxAttempts
    assert {r[1] for r in letters} <= {"unknown_topic", "unknown_topic_or_part"}
    assert sum(r["records"] for r in done) == RECORDS and sum(r["dead_lettered"] for r in done) == len(refused)
    assert {r["shard"] for r in done} == {0, 1}
    assert Counter((r["shard"], r["batch"]) for r in done).most_common(1)[0][1] == 2  # two tasks of a shard's batch

    count = RECORDS - len(refused)
    values: dict[str, list[int]] = defaultdict(list)
    for msg in read_messages(services.bootstrap, [good], count):
        values[text(msg.key())].append(int(text(msg.value())[1:]))
    assert sum(len(v) for v in values.values()) == count  # 0 lost
    assert all(v == sorted(v) for v in values.values())  # per-key order
    assert len(deduplicated(services, good, partitions=2)) == count  # each once through the reader

"""The ``outbox`` source on a standalone cluster: drivers submitted with ``spark-submit``, the package
shipped to the executors with ``--py-files``, executors in JVMs and Python workers of their own."""

from __future__ import annotations

import json
from collections import Counter, defaultdict
from collections.abc import Callable
from pathlib import Path
from typing import Any

import psycopg
import pytest
import yaml
from psycopg import sql

from harvester.core.identity import Identity
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table, migrate
from harvester.spark.drain.offsets import planned_ids
from harvester.spark.store import SinkTables, clean_stale
from tests.spark.cluster import EXECUTOR_CORES, StandaloneCluster, executor_of, kill_tree
from tests.spark.drivers import LOST_ROWS, Driver, SharedDriver
from tests.spark.test_batch import leftovers, records, wait_for_stragglers
from tests.spark.test_stream import PER_FILE, write_inputs
from tests.spark_drain.conftest import deduplicated, preload, preload_a_third_missing, remaining
from tests.support.kafka import consumed_headers, create_topics, delete_topics, end_offsets, read_messages, text
from tests.support.names import unique
from tests.support.reaper import run_reaper
from tests.support.services import Services

# Every driver and server is a JVM of its own: minutes on a loaded two-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

Conn = psycopg.Connection[tuple[object, ...]]
# Micro-batches of the streaming test: 0 commits, 1 fails, 2 commits and the driver dies; each costs
# seconds on a cluster, so there are no more.
FILES = 3
DRAIN_RECORDS = 1_000  # five micro-batches of 200 (100 per shard); shard 0's third is held
PUBLISH_RECORDS = 600  # three micro-batches of 200, a third of them to a topic that does not exist


def config(services: Services, tmp_path: Path, **more: Any) -> dict[str, Any]:
    """What every scenario needs: the DSN, a fault directory and a result file (all on local disk,
    which driver and executors share here)."""
    faults = tmp_path / "faults"
    faults.mkdir(exist_ok=True)
    return {"dsn": services.pg_dsn, "faults": str(faults), "result": str(tmp_path / unique("result")), **more}


def by_key(rows: list[tuple[Any, ...]]) -> dict[str, list[int]]:
    """Each key's values as numbers, in id order."""
    found: dict[str, list[int]] = defaultdict(list)
    for _, key, value, _, _ in rows:
        found[key].append(int(value))
    return found


def test_batch_writes_on_the_cluster(
    driver: SharedDriver, services: Services, pg: Conn, schema: str, tmp_path: Path
) -> None:
    tables = {name: TableName(schema, name) for name in ("retried", "failed", "ordered", "business")}
    for table in tables.values():
        migrate(pg, table)
    totals = sql.Identifier(schema, "totals")
    pg.execute(sql.SQL("CREATE TABLE {} (key TEXT PRIMARY KEY, n BIGINT NOT NULL)").format(totals))
    upsert = sql.SQL(
        "INSERT INTO {} SELECT key, count(*) FROM outbox_batch GROUP BY key"
        " ON CONFLICT (key) DO UPDATE SET n = {}.n + excluded.n"
    ).format(totals, totals)
    settings = config(
        services,
        tmp_path,
        commitSql=upsert.as_string(pg),
        **{name: table.qualified for name, table in tables.items()},
    )
    result = driver.run("batch", settings)

    # The executors imported this package from the shipped archive, not from any installation.
    assert len(result["imported"]) == 4
    assert all(path.endswith("/outbox_harvester.zip/harvester/__init__.py") for path in result["imported"])
    # The retried write's first attempt, and both attempts of the failed write's partition 1.
    assert sorted(p.name.split("-")[1] for p in Path(settings["faults"]).iterdir()) == ["p1a0", "p1a0", "p1a1"]

    retried = records(pg, tables["retried"])
    assert sorted(int(v) for _, _, v, _, _ in retried) == list(range(4000))
    assert all(values == sorted(values) for values in by_key(retried).values())

    assert "injected fault stage p1" in result["failed"]
    assert records(pg, tables["failed"]) == []
    wait_for_stragglers(pg, tables["failed"])  # attempts still running at the abort may stage afterwards
    clean_stale(pg, tables["failed"], 0)

    ordered = by_key(records(pg, tables["ordered"]))
    assert len(ordered) == 5
    assert all(values == sorted(values) and len(values) == 120 for values in ordered.values())

    counted = pg.execute(sql.SQL("SELECT key, n FROM {} ORDER BY key").format(totals)).fetchall()
    assert counted == [(str(k), 20) for k in range(7)]
    assert len(records(pg, tables["business"])) == 140
    assert all(leftovers(pg, table) == (0, 0) for table in tables.values())


def test_stream_resumes_exactly_once_after_the_driver_is_killed(
    spark_cluster: StandaloneCluster,
    shipped: list[Path],
    packed_env: tuple[Path, Path],
    driver: SharedDriver,
    services: Services,
    pg: Conn,
    outbox: TableName,
    tmp_path: Path,
) -> None:
    source = tmp_path / "in"
    write_inputs(source, FILES)
    settings = config(
        services,
        tmp_path,
        table=outbox.qualified,
        sinkId=unique("sink"),
        source=str(source),
        checkpoint=str(tmp_path / "checkpoint"),
    )
    faults = Path(settings["faults"])
    # Batch 1's commit fails before the database; the query restarts; batch 2's commit reaches the
    # database and the driver is killed before Spark records the batch. This driver ships the package
    # the packed-environment way (docs/spark.md): its Python is the environment's, its executors'
    # the unpacked archive's, and only the tests' own modules come through --py-files.
    env, archive = packed_env
    crashing = Driver(
        spark_cluster,
        shipped[1:],
        "stream",
        {**settings, "phase": "crash"},
        env={"PYSPARK_DRIVER_PYTHON": str(env / "bin" / "python"), "PYSPARK_PYTHON": "./environment/bin/python"},
        # One executor: it proves the archive's path as two would, and boots one JVM fewer.
        conf={"spark.archives": f"{archive}#environment", "spark.cores.max": str(EXECUTOR_CORES)},
        cwd=env.parent,  # where ./environment is the environment, for the driver's own Python processes
    )
    crashing.wait_for(lambda: any(faults.glob("commitAfter-b2-*")))
    crashing.kill()
    result = json.loads(Path(settings["result"]).read_text())
    assert "injected fault commitBefore b1" in result["failed"]
    assert len(result["imported"]) == 2
    assert all("/environment/lib/" in path for path in result["imported"]), result["imported"]
    assert all(path.endswith("/site-packages/harvester/__init__.py") for path in result["imported"])
    # A new driver, from the checkpoint: batch 2 is replayed and skipped, the rest written.
    driver.run("stream", {**settings, "phase": "finish"})

    values = [int(v) for _, _, v, _, _ in records(pg, outbox)]
    assert sorted(values) == list(range(FILES * PER_FILE))
    committed = pg.execute(
        sql.SQL("SELECT batch_id, records FROM {} WHERE sink_id = %s ORDER BY batch_id").format(
            SinkTables.of(outbox).commits
        ),
        (settings["sinkId"],),
    ).fetchall()
    assert committed == [(b, PER_FILE) for b in range(FILES)]
    assert leftovers(pg, outbox) == (0, 0)


def test_executor_lost_mid_write_commits_every_row_once_and_nothing_of_the_lost_attempts(
    spark_cluster: StandaloneCluster,
    driver: SharedDriver,
    services: Services,
    pg: Conn,
    outbox: TableName,
    tmp_path: Path,
) -> None:
    settings = config(services, tmp_path, table=outbox.qualified, rows=LOST_ROWS)
    faults = Path(settings["faults"])
    names = SinkTables.of(outbox)
    result = driver.start("lost", settings)
    victim: int | None = None
    try:
        # The four first attempts hold, two per executor: one in the middle of its staging COPY,
        # one after its staging transaction committed.
        driver.wait_for(result, lambda: len(list(faults.glob("hold-*"))) == 4)
        held = {p.name: spark_cluster.worker_of(int(p.name.rsplit("-", 1)[1])) for p in faults.glob("hold-*")}
        victim = held[min(held)]  # the worker of an "after" attempt, whose staged rows are committed
        lost = {name.split("-")[2] for name, worker in held.items() if worker == victim}  # e.g. p2a0
        assert victim is not None and len(lost) == 2, held
        staged = pg.execute(
            sql.SQL(
                "SELECT count(*) FROM {} JOIN {} USING (task_id)"
                " WHERE format('p%%sa%%s', partition_id, attempt) = ANY(%s)"
            ).format(names.staging, names.tasks),
            (sorted(lost),),
        ).fetchone()
        assert staged is not None and int(str(staged[0])) > 0  # a lost attempt's rows sit in staging
        spark_cluster.kill_worker(victim)
        (faults / "release").touch()
        driver.finish(result)
    finally:
        (faults / "release").touch()
        if victim is not None and spark_cluster.workers[victim] is None:
            spark_cluster.start_worker(victim)

    tagged = [str(v).split("@") for _, _, v, _, _ in records(pg, outbox)]
    assert sorted(int(n) for n, _ in tagged) == list(range(LOST_ROWS))  # every row, exactly once
    attempts = {tag for _, tag in tagged}
    assert not attempts & lost  # no row of a lost attempt was committed
    # One attempt per partition: for the lost ones, the one Spark ran again elsewhere.
    assert sorted(a.split("a")[0] for a in attempts) == ["p0", "p1", "p2", "p3"]
    assert leftovers(pg, outbox) == (0, 0)  # the lost attempts' staged rows are gone


def held_batch(checkpoint: Path, shard: int, batch: int) -> set[int]:
    """The ids the checkpoint's offset log planned for ``shard``'s batch number ``batch``."""
    for planned in (checkpoint / "offsets").iterdir():
        if planned.name.isdigit():
            part = json.loads(planned.read_text().splitlines()[2]).get(str(shard), {})
            if part.get("batch") == batch:
                return set(planned_ids(part))
    raise AssertionError(f"no batch {batch} of shard {shard} in {checkpoint}")


def delivered(services: Services, topic: str) -> dict[str, list[int]]:
    """Per key, the outbox ids the topic holds now, in its order."""
    total = end_offsets(services.bootstrap, topic, partitions=2)
    out: dict[str, list[int]] = defaultdict(list)
    for msg in read_messages(services.bootstrap, [topic], total):
        identity = Identity.from_headers(consumed_headers(msg))
        assert identity is not None
        out[text(msg.key())].append(identity.id)
    return out


def test_drain_loses_an_executor_mid_batch_and_delivers_every_record_once_through_the_reader(
    driver: SharedDriver,
    services: Services,
    pg: Conn,
    outbox: TableName,
    topics: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic, group = topics(partitions=2), unique("group")
    ids = preload(pg, outbox, topic, DRAIN_RECORDS, keys=30)
    # 2 kB values: the held task's first records fill its Python worker's 64 kB output buffer, so
    # they reach the executor's Kafka producer before it holds.
    pg.execute(sql.SQL("UPDATE {} SET kafka_value = kafka_value || repeat('x', 2000)").format(outbox.ident))
    checkpoint = tmp_path / "cp"
    settings = config(
        services,
        tmp_path,
        table=outbox.qualified,
        bootstrap=services.bootstrap,
        group=group,
        checkpoint=str(checkpoint),
    )
    faults = Path(settings["faults"])
    result = driver.start("drain", settings)
    try:
        # Shard 0's task of its third batch holds halfway through its records, on one executor...
        driver.wait_for(result, lambda: any(faults.glob("hold-read-*")))
        (held,) = faults.glob("hold-read-*")
        executor = executor_of(int(held.name.rsplit("-", 1)[1]))
        assert executor is not None, held
        lost = held_batch(checkpoint, shard=0, batch=3)
        assert len(remaining(pg, outbox)) < len(ids)  # batches before it were delivered and purged
        # ... and some of them are in Kafka already: the batch is being written.
        driver.wait_for(result, lambda: any(i in lost for got in delivered(services, topic).values() for i in got))
        # The executor's JVM and its Python workers; its worker starts the application another one.
        kill_tree(executor)
        driver.finish(result)
    finally:
        (faults / "release").touch()
        delete_topics(services.bootstrap, [f"{group}.neli"])

    assert remaining(pg, outbox) == []  # nothing purged before the retried batch's sink committed
    by_key = delivered(services, topic)
    every = [i for got in by_key.values() for i in got]
    assert sorted(set(every)) == ids  # none lost
    twice = {i for i, n in Counter(every).items() if n > 1}
    assert twice and twice <= lost  # duplicates: only (and some) of the lost attempt's records
    for got in by_key.values():
        firsts = list(dict.fromkeys(got))
        assert firsts == sorted(firsts)  # per-key order, across the lost attempt and its retry
    assert sorted(deduplicated(services, topic, partitions=2)) == ids  # none twice through the reader


def test_publish_sink_dead_letters_a_missing_topic_and_the_replay_delivers_it(
    driver: SharedDriver,
    services: Services,
    pg: Conn,
    outbox: TableName,
    topics: Callable[..., str],
    tmp_path: Path,
) -> None:
    good, missing = topics(partitions=2), unique("missing")  # the brokers do not create topics here
    refused = preload_a_third_missing(pg, outbox, good, missing, PUBLISH_RECORDS)  # a third of the keys: k0, k3, ...
    settings = config(
        services, tmp_path, table=outbox.qualified, bootstrap=services.bootstrap, checkpoint=str(tmp_path / "cp")
    )
    reaper_file = tmp_path / "reaper.yaml"
    harvest = {"dataSource": services.pg_dsn, "outboxTable": outbox.qualified}
    reaper_file.write_text(yaml.safe_dump({"harvest": harvest}))
    try:
        driver.run("publish", settings)
        # The rest was drained; the missing topic's records are dead letters with the broker's reason.
        assert remaining(pg, outbox) == []
        letters = pg.execute(
            sql.SQL("SELECT id, reason, error, attempts FROM {} ORDER BY id").format(dead_letter_table(outbox).ident)
        ).fetchall()
        assert [int(str(r[0])) for r in letters] == refused
        assert {r[3] for r in letters} == {3}  # after a reaper's 3 attempts
        assert {r[1] for r in letters} <= {"unknown_topic", "unknown_topic_or_part"}
        assert all("nknown topic" in str(r[2]) for r in letters)
        # Once the topic exists, 'reaper dlq replay' puts them back and the same query publishes them.
        create_topics(services.bootstrap, [missing], partitions=2)
        replayed = run_reaper("dlq", "replay", "--all", "--yes", "-f", str(reaper_file))
        assert replayed.returncode == 0, replayed.stderr
        driver.run("publish", settings)
        assert remaining(pg, outbox) == []
        assert pg.execute(sql.SQL("SELECT count(*) FROM {}").format(dead_letter_table(outbox).ident)).fetchone() == (0,)
        for topic, count in ((good, PUBLISH_RECORDS - len(refused)), (missing, len(refused))):
            messages = read_messages(services.bootstrap, [topic], count)
            assert end_offsets(services.bootstrap, topic, partitions=2) == count  # 0 lost, 0 duplicates
            values: dict[str, list[int]] = defaultdict(list)
            for msg in messages:
                values[text(msg.key())].append(int(text(msg.value())[1:]))
            assert all(v == sorted(v) for v in values.values())  # per-key order, the replayed ones too
            assert len(set(deduplicated(services, topic, partitions=2))) == count  # each once through the reader
    finally:
        delete_topics(services.bootstrap, [missing])

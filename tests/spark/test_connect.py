"""The ``outbox`` source from a Spark Connect client: registered from the client, the package shipped
to the server as a session artifact, batch and streaming writes planned and committed server-side;
and a streaming drain over Connect on the standalone cluster (docs/spark.md's recipe)."""

from __future__ import annotations

from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from pyspark.errors import StreamingQueryException
from pyspark.sql.connect.session import SparkSession as RemoteSparkSession

from harvester.postgres.schema.identifiers import TableName
from harvester.spark import register
from harvester.spark.drain.kafka_sink import KafkaPartitionError
from harvester.spark.store import SinkTables
from tests.spark import faults
from tests.spark.cluster import ConnectServer
from tests.spark.jobs import harvester_file, numbered, run_stream
from tests.spark.test_batch import leftovers, records
from tests.spark.test_stream import PER_FILE, write_inputs
from tests.spark_drain.conftest import preload, remaining
from tests.support.kafka import end_offsets, read_messages, text
from tests.support.names import unique
from tests.support.services import Services

# Every driver and server is a JVM of its own: minutes on a loaded two-core machine.
pytestmark = [pytest.mark.integration, pytest.mark.timeout(900)]

Conn = psycopg.Connection[tuple[object, ...]]
DRAINED = 200  # two micro-batches of 100 (50 per shard)


@pytest.fixture(scope="module")
def remote(connect_server: ConnectServer, shipped: list[Path]) -> Iterator[RemoteSparkSession]:
    """A Connect session with the package and the tests' faulty source shipped as artifacts (the
    Connect equivalent of ``--py-files``), both sources registered."""
    # The Connect class itself, not ``pyspark.sql.SparkSession.builder.remote``, which would switch
    # this whole process (and the local-mode session the other tests share) to Connect mode.
    connect_server.wait()
    session = RemoteSparkSession.builder.remote(connect_server.url).getOrCreate()
    for path in shipped:
        session.addArtifacts(str(path), pyfile=True)
    register(session)
    session.dataSource.register(faults.FaultyOutbox)
    yield session
    session.stop()


def test_batch_write_over_connect(
    remote: RemoteSparkSession, sink: dict[str, str], pg: Conn, outbox: TableName, tmp_path: Path
) -> None:
    (where,) = remote.range(1).mapInArrow(harvester_file, "file string").collect()
    assert where.file.endswith("/outbox_harvester.zip/harvester/__init__.py"), where.file
    # Planned, staged and committed by the server's Python workers, with a retried task.
    numbered(remote, 4000, 4).write.format("outbox_faulty").mode("append").options(
        **sink, topic="orders", faultAt="stage", faultPartition="1", faultAttempt="0", faultDir=str(tmp_path)
    ).save()
    assert [p.name.split("-")[1] for p in tmp_path.iterdir()] == ["p1a0"]
    assert [int(v) for _, _, v, _, _ in records(pg, outbox)] == list(range(4000))
    assert leftovers(pg, outbox) == (0, 0)


def test_streaming_write_over_connect_resumes_exactly_once(
    remote: RemoteSparkSession, sink: dict[str, str], pg: Conn, outbox: TableName, tmp_path: Path
) -> None:
    source, checkpoint, fault_dir = tmp_path / "in", tmp_path / "checkpoint", tmp_path / "faults"
    write_inputs(source, 3)
    fault_dir.mkdir()
    options = {**sink, "topic": "counts", "sinkId": unique("sink"), "faultDir": str(fault_dir)}
    with pytest.raises(Exception, match="injected fault commitBefore b1"):
        run_stream(remote, source, checkpoint, "outbox_faulty", **options, faultAt="commitBefore", faultBatch="1")
    run_stream(remote, source, checkpoint, "outbox", **options)

    assert sorted(int(v) for _, _, v, _, _ in records(pg, outbox)) == list(range(3 * PER_FILE))
    committed = pg.execute(
        sql.SQL("SELECT batch_id, records FROM {} WHERE sink_id = %s ORDER BY batch_id").format(
            SinkTables.of(outbox).commits
        ),
        (options["sinkId"],),
    ).fetchall()
    assert committed == [(b, PER_FILE) for b in range(3)]
    assert leftovers(pg, outbox) == (0, 0)


def test_spark_kafka_sink_over_connect_refuses_the_drain_without_its_partition_column(
    remote: RemoteSparkSession, sink: dict[str, str], tmp_path: Path
) -> None:
    writer = (
        remote.readStream.format("outbox")
        .options(**sink)
        .load()
        .selectExpr("topic", "key", "value", "headers")
        .writeStream.format("kafka")
        .option("checkpointLocation", str(tmp_path / "cp"))
    )
    with pytest.raises(KafkaPartitionError, match="without its 'partition' column"):
        writer.start()  # refused in the client: no query reaches the server


def test_streaming_drain_over_connect_on_the_cluster(
    cluster_connect: ConnectServer,
    shipped: list[Path],
    services: Services,
    pg: Conn,
    outbox: TableName,
    topics: Callable[..., str],
    tmp_path: Path,
) -> None:
    topic = topics(partitions=2)
    preload(pg, outbox, topic, DRAINED, keys=10)
    cluster_connect.wait()
    # create(), not getOrCreate(), which would hand back the local server's session of this process.
    session = RemoteSparkSession.builder.remote(cluster_connect.url).create()
    try:
        session.addArtifacts(str(shipped[0]), pyfile=True)  # the only copy its Python workers can import
        register(session)
        table = {"dsn": services.pg_dsn, "table": outbox.qualified}
        writer = (
            session.readStream.format("outbox")
            .options(**table, shards="2", maxRecordsPerTrigger=str(DRAINED // 2))
            .load()
            .writeStream.format("outbox-publish")
            .options(**table, checkpointLocation=str(tmp_path / "cp"))
            .option("kafka.bootstrap.servers", services.bootstrap)
            .trigger(availableNow=True)
        )
        try:
            writer.start().awaitTermination()
        except StreamingQueryException as exc:
            # Spark waits a fixed 10 s for the source's Python runner to connect back as the query
            # starts, which a load average of 30 on two cores can exceed, before anything is planned:
            # then start again, once.
            if "Python worker failed to connect back" not in str(exc) or "Committed Offsets: {}" not in str(exc):
                raise
            writer.start().awaitTermination()
    finally:
        session.stop()

    assert remaining(pg, outbox) == []
    by_key: dict[str, list[int]] = defaultdict(list)
    for msg in read_messages(services.bootstrap, [topic], DRAINED):
        by_key[text(msg.key())].append(int(text(msg.value())[1:]))
    assert sorted(v for got in by_key.values() for v in got) == list(range(1, DRAINED + 1))  # none lost
    assert all(got == sorted(got) for got in by_key.values())  # per-key order
    assert end_offsets(services.bootstrap, topic, partitions=2) == DRAINED  # none twice

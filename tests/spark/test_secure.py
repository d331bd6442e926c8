"""The Spark sink and drain through the secure services, in the Spark tests' local-mode session: a
writer role made of ``reaper grants --spark-sink`` writes a DataFrame into the outbox with ``format("outbox")``, and
``readStream.format("outbox")`` into ``writeStream.format("outbox-publish")`` drains it as the
reaper's least-privileged role and principal: the CA, the SCRAM credentials and the TLS settings go
in the options (``dsn`` and ``kafka.*``), as docs/spark.md says. A writer role short of a grant is
refused before a row moves, in one line naming the GRANT."""

from __future__ import annotations

import re
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from pyspark.sql import SparkSession

from tests.secure import services as s
from tests.secure.test_drain import acls
from tests.support.kafka import read_messages, text
from tests.support.names import unique
from tests.support.reaper import run_reaper


def writer(config: Path) -> str:
    """A role of ``reaper grants --spark-sink``'s output and nothing more."""
    role = unique("wr")
    script = run_reaper("grants", "--spark-sink", "--role", role, "-f", str(config))
    assert script.returncode == 0, script.stderr
    with psycopg.connect(s.pg_dsn(), autocommit=True) as conn:
        conn.execute(script.stdout.encode())
        conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(role), s.PASSWORD))
    return role


@pytest.fixture(scope="module")
def made(secure: None, tmp_path_factory: pytest.TempPathFactory) -> tuple[s.Outbox, Path]:
    """An outbox migrated by its owner, and the reaper file its grants are printed from."""
    where = tmp_path_factory.mktemp("spark")
    return s.outbox(where, {}), where / "grants.yaml"


@pytest.mark.timeout(900)  # with the session's start, when this file runs alone
def test_spark_writes_and_drains_least_privileged(
    spark: SparkSession, made: tuple[s.Outbox, Path], tmp_path: Path
) -> None:
    box, grants = made
    group = f"outbox-harvester.{box.table}"
    topic = f"out_{box.schema}"
    s.create_topics([topic, f"{group}.neli"], partitions=2)
    user = s.principal(acls(group, topic, exactly_once=False))
    role = writer(grants)
    kafka = {f"kafka.{k}": str(v) for k, v in s.kafka_config(user, s.PASSWORD).items()}

    rows = spark.range(1, 201, numPartitions=2).selectExpr("concat('k', id % 7) AS key", "concat('v', id) AS value")
    rows.write.format("outbox").mode("append").option("dsn", s.pg_dsn(role, s.PASSWORD)).option(
        "table", box.table
    ).option("topic", topic).option("orderColumn", "value").save()
    assert s.backlog(box.table) == 200

    runtime = s.pg_dsn(box.runtime, s.PASSWORD)
    records = (
        spark.readStream.format("outbox")
        .option("dsn", runtime)
        .option("table", box.table)
        .options(**kafka)  # joins the leader group as the principal
        .load()
    )
    query = (
        records.writeStream.format("outbox-publish")
        .option("dsn", runtime)
        .option("table", box.table)
        .options(**kafka)
        .option("checkpointLocation", str(tmp_path / "cp"))
        .trigger(availableNow=True)
        .start()
    )
    query.awaitTermination(180)
    assert query.exception() is None
    assert s.backlog(box.table) == 0
    security = s.kafka_config()
    got = read_messages(security.pop("bootstrap.servers"), [topic], 200, **security)
    assert sorted(int(text(m.value())[1:]) for m in got) == list(range(1, 201))
    with psycopg.connect(s.pg_dsn(), autocommit=True) as conn:
        letters = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(box.schema, "outbox_dead_letter"))
        )
        assert letters.fetchone() == (0,)


@pytest.mark.timeout(900)  # with the session's start, when this file runs alone
def test_a_writer_short_of_a_grant_is_refused_in_one_line_naming_it(
    spark: SparkSession, made: tuple[s.Outbox, Path]
) -> None:
    """The writer's grants are checked on the driver before any task stages a row: a role of
    ``reaper grants --spark-sink`` less INSERT on the outbox fails the write with the GRANT that fixes
    it, and nothing is staged or committed."""
    box, grants = made
    role = writer(grants)
    with psycopg.connect(s.pg_dsn(), autocommit=True) as conn:
        conn.execute(
            sql.SQL("REVOKE INSERT ON {} FROM {}").format(sql.Identifier(box.schema, "outbox"), sql.Identifier(role))
        )
    before = s.backlog(box.table)
    rows = spark.range(1, 11, numPartitions=2).selectExpr("concat('k', id) AS key", "concat('v', id) AS value")
    fix = f"GRANT INSERT ON {box.table} TO {role} (see 'reaper grants --spark-sink')"
    with pytest.raises(Exception, match=re.escape(f"role {role} lacks INSERT on {box.table}: {fix}")):
        rows.write.format("outbox").mode("append").option("dsn", s.pg_dsn(role, s.PASSWORD)).option(
            "table", box.table
        ).option("topic", f"out_{box.schema}").save()
    assert s.backlog(box.table) == before
    with psycopg.connect(s.pg_dsn(), autocommit=True) as conn:
        staged = conn.execute(
            sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(box.schema, "outbox_spark_staging"))
        )
        assert staged.fetchone() == (0,)

"""End to end: the example pipeline's output topic receives every customer's total through the harvester."""

from __future__ import annotations

import json
from collections import Counter
from collections.abc import Callable
from pathlib import Path

import psycopg
import pytest
from psycopg import sql
from pyspark.sql import SparkSession

from examples.spark_pipeline import order, parse_args, run
from tests.support.kafka import delete_topics, read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

EVENTS, CUSTOMERS = 300, 7


def test_example_pipeline_publishes_every_total(
    spark: SparkSession,
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    topics: Callable[..., str],
    tmp_path: Path,
) -> None:
    source, output = topics(), topics()
    # The example's own session would start a second JVM; it runs in this one (which has the
    # Kafka connector) exactly as `python examples/spark_pipeline.py <these arguments>` runs it.
    args = parse_args(
        [
            "--bootstrap", services.bootstrap, "--dsn", services.pg_dsn, "--table", f"{schema}.outbox",
            "--input-topic", source, "--output-topic", output, "--events", str(EVENTS),
            "--customers", str(CUSTOMERS), "--sink-id", unique("example"), "--checkpoint", str(tmp_path / "checkpoint"),
        ]
    )  # fmt: skip
    try:
        run(spark, args)
    finally:
        # The embedded harvester's elector created its leader topic; nothing else removes it.
        delete_topics(services.bootstrap, [f"outbox-example.{schema}.outbox.neli"])

    totals: Counter[str] = Counter()
    counts: Counter[str] = Counter()
    for n in range(EVENTS):
        body = order(n, CUSTOMERS)
        totals[str(body["customer"])] += int(body["amount"])
        counts[str(body["customer"])] += 1
    expected = {c: {"customer": c, "total": totals[c], "orders": counts[c]} for c in totals}

    batches = pg.execute(
        sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, "outbox_spark_commits"))
    ).fetchone()
    assert batches is not None and int(str(batches[0])) >= 1
    # Complete output mode: each micro-batch publishes every customer's total.
    messages = read_messages(services.bootstrap, [output], CUSTOMERS * int(str(batches[0])))
    assert len(messages) == CUSTOMERS * int(str(batches[0]))
    latest = {(m.key() or b"").decode(): json.loads(m.value() or b"null") for m in messages}
    assert latest == expected
    stored = pg.execute(
        sql.SQL("SELECT customer, total, orders FROM {}").format(sql.Identifier(schema, "customer_totals"))
    ).fetchall()
    assert {c: {"customer": c, "total": t, "orders": o} for c, t, o in stored} == expected

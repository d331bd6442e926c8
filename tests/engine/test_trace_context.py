"""Trace context through the outbox (the ``otel`` extra), on real PostgreSQL and Kafka: a record
carries the span current when it was stashed, and the harvester's publish span links to it."""

from __future__ import annotations

import asyncio
import json
import subprocess
import sys
from collections.abc import Callable, Iterator
from typing import Any

import psycopg
import pytest
from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import SimpleSpanProcessor
from opentelemetry.sdk.trace.export.in_memory_span_exporter import InMemorySpanExporter
from opentelemetry.trace import NonRecordingSpan, SpanContext, TraceFlags, TraceState
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from harvester import AsyncStasher, HarvesterConfig, MessageStasher, OutboxRecord, Stasher
from harvester.postgres.schema.identifiers import TableName
from tests.engine.test_stasher import rows
from tests.engine.workload import wait_drained, wait_until
from tests.log.conftest import logical_dsn, message_outbox, tableless  # noqa: F401  (fixtures)
from tests.support.harvesters import HarvesterFactory, harvesters
from tests.support.kafka import consumed_headers, delete_topics, read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

# The global tracer provider can be set once per process: one exporter for the module, cleared per test.
_EXPORTER = InMemorySpanExporter()


@pytest.fixture(scope="module")
def tracer() -> Iterator[trace.Tracer]:
    provider = TracerProvider()
    provider.add_span_processor(SimpleSpanProcessor(_EXPORTER))
    trace.set_tracer_provider(provider)
    assert trace.get_tracer_provider() is provider, "another test set the global tracer provider first"
    yield provider.get_tracer("tests")
    provider.shutdown()  # later tests' harvesters still trace, but nothing is kept


@pytest.fixture
def spans(tracer: trace.Tracer) -> Iterator[InMemorySpanExporter]:
    _EXPORTER.clear()
    yield _EXPORTER
    _EXPORTER.clear()


def traceparent(context: SpanContext) -> str:
    return f"00-{context.trace_id:032x}-{context.span_id:016x}-{context.trace_flags:02x}"


def remote_parent() -> Any:
    """A context as an incoming request would bring it, with a vendor's tracestate."""
    parent = SpanContext(
        trace_id=0x5CE0E9A56015FEC5AADFA328AE398115,
        span_id=0xAB54A98CEB1F0AD2,
        is_remote=True,
        trace_flags=TraceFlags(TraceFlags.SAMPLED),
        trace_state=TraceState([("vendor", "opaque")]),
    )
    return trace.set_span_in_context(NonRecordingSpan(parent))


def stash_all(services: Services, outbox: TableName, topic: str, tracer: trace.Tracer) -> dict[str, SpanContext]:
    """Stash one record per case; return the span context each traced record must carry."""
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with (
        tracer.start_as_current_span("sync request", context=remote_parent()) as sync_span,
        psycopg.connect(services.pg_dsn) as conn,
        conn.transaction(),
    ):
        Stasher(outbox).stash(conn, OutboxRecord.of(topic, "sync", "1"))
        Stasher(outbox).stash(conn, OutboxRecord.of(topic, "own", "2", {"traceparent": own}))
        Stasher(outbox, trace_context=False).stash(conn, OutboxRecord.of(topic, "off", "3"))
        Stasher(outbox).stash(conn, OutboxRecord.of(topic, "garbage", "6", {"traceparent": "not a traceparent"}))

    async def stash_async() -> None:
        async with await psycopg.AsyncConnection.connect(services.pg_dsn) as conn, conn.transaction():
            await AsyncStasher(outbox).stash(conn, OutboxRecord.of(topic, "async", "4"))

    with tracer.start_as_current_span("async request") as async_span:
        asyncio.run(stash_async())
    with psycopg.connect(services.pg_dsn) as conn, conn.transaction():
        Stasher(outbox).stash(conn, OutboxRecord.of(topic, "no span", "5"))
    return {"sync": sync_span.get_span_context(), "async": async_span.get_span_context()}


def links_of(spans: InMemorySpanExporter) -> list[tuple[ReadableSpan, dict[int, str]]]:
    """Each finished publish span with its links (span id -> linked outbox id)."""
    return [
        (span, {link.context.span_id: str((link.attributes or {}).get("messaging.message.id")) for link in span.links})
        for span in spans.get_finished_spans()
        if span.name == "publish"
    ]


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_records_carry_the_stash_time_span_and_the_publish_span_links_to_it(
    services: Services,
    outbox: TableName,
    topics: Callable[..., str],
    make_harvester: HarvesterFactory,
    tracer: trace.Tracer,
    spans: InMemorySpanExporter,
    delivery: str,
) -> None:
    topic, group = topics(), unique("traced")
    stashed = stash_all(services, outbox, topic, tracer)
    assert len(rows(services, outbox)) == 6
    harvester = make_harvester(settings={"delivery": delivery, "leader_group_id": group})
    try:
        assert wait_drained(services.pg_dsn, outbox) == 0
        committed: dict[str, Any] = {"isolation.level": "read_committed"}
        messages = read_messages(services.bootstrap, [topic], 6, **committed)
    finally:
        harvester.stop(timeout=5)
        delete_topics(services.bootstrap, [f"{group}.checkpoints"] if delivery == "exactly_once" else [])
    headers = {(m.key() or b"").decode(): dict(consumed_headers(m) or []) for m in messages}
    assert len(messages) == 6
    assert headers["sync"]["traceparent"] == traceparent(stashed["sync"]).encode()
    assert headers["sync"]["tracestate"] == b"vendor=opaque"
    assert headers["async"]["traceparent"] == traceparent(stashed["async"]).encode()
    assert "tracestate" not in headers["async"]
    assert headers["own"]["traceparent"] == b"00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    assert "traceparent" not in headers["off"] and "traceparent" not in headers["no span"]
    assert headers["garbage"]["traceparent"] == b"not a traceparent"  # published as is, linked to nothing

    # A consumer continues the trace from the headers, as docs/client.md shows.
    carrier = {k: (v or b"").decode() for k, v in headers["sync"].items() if k in ("traceparent", "tracestate")}
    with tracer.start_as_current_span("process", context=TraceContextTextMapPropagator().extract(carrier)) as process:
        pass
    assert process.get_span_context().trace_id == stashed["sync"].trace_id
    assert isinstance(process, ReadableSpan) and process.parent is not None
    assert process.parent.span_id == stashed["sync"].span_id

    # One link per record with a valid context (the garbage one has none), naming its outbox id.
    keys = {stashed["sync"].span_id: "sync", stashed["async"].span_id: "async", 0xB7AD6B7169203331: "own"}
    assert wait_until(lambda: sum(len(found) for _, found in links_of(spans)) >= len(keys))
    linked = {span_id: outbox_id for _, found in links_of(spans) for span_id, outbox_id in found.items()}
    assert {keys[span_id]: outbox_id.encode() for span_id, outbox_id in linked.items()} == {
        key: headers[key]["outbox-id"] for key in keys.values()
    }
    for span, _ in links_of(spans):
        assert span.kind == trace.SpanKind.PRODUCER
        assert span.attributes is not None and span.attributes["messaging.destination.name"] == topic


@pytest.mark.parametrize("delivery", ["at_least_once", "exactly_once"])
def test_a_table_less_outbox_s_records_carry_the_stash_time_span(
    request: pytest.FixtureRequest,
    services: Services,
    topics: Callable[..., str],
    tracer: trace.Tracer,
    delivery: str,
) -> None:
    """MessageStasher (trace_context=True, its default) writes the current span's context into the
    logical message; the harvester publishes it as the record's headers."""
    dsn: str = request.getfixturevalue("logical_dsn")
    table: TableName = request.getfixturevalue("message_outbox")
    topic = topics()
    own = "00-0af7651916cd43dd8448eb211c80319c-b7ad6b7169203331-01"
    with (
        tracer.start_as_current_span("request", context=remote_parent()) as span,
        psycopg.connect(dsn) as conn,
        conn.transaction(),
    ):
        MessageStasher(table).stash(conn, OutboxRecord.of(topic, "traced", "1"))
        MessageStasher(table).stash(conn, OutboxRecord.of(topic, "own", "2", {"traceparent": own}))
        MessageStasher(table, trace_context=False).stash(conn, OutboxRecord.of(topic, "off", "3"))

    def config() -> HarvesterConfig:
        return HarvesterConfig(
            data_source=dsn,
            outbox_table=table.qualified,
            delivery=delivery,  # type: ignore[arg-type]
            base_kafka_config={"bootstrap.servers": services.bootstrap},
            **tableless(),
        )

    group = HarvesterConfig(outbox_table=table.qualified).group_id
    with harvesters(config) as make:
        make()
        committed: dict[str, Any] = {"isolation.level": "read_committed"}
        messages = read_messages(services.bootstrap, [topic], 3, **committed)
    delete_topics(services.bootstrap, [f"{group}.checkpoints"] if delivery == "exactly_once" else [])
    headers = {(m.key() or b"").decode(): dict(consumed_headers(m) or []) for m in messages}
    assert len(messages) == 3
    assert headers["traced"]["traceparent"] == traceparent(span.get_span_context()).encode()
    assert headers["traced"]["tracestate"] == b"vendor=opaque"
    assert headers["own"]["traceparent"] == own.encode()
    assert "traceparent" not in headers["off"] and "tracestate" not in headers["off"]


def test_without_opentelemetry_stashing_works_and_adds_no_header(services: Services, outbox: TableName) -> None:
    probe = f"""
import asyncio, json, sys
sys.modules["opentelemetry"] = None  # as if the otel extra were not installed
import psycopg
from harvester import AsyncStasher, HarvesterConfig, MessageStasher, OutboxRecord, Stasher
from harvester.compose import tracing
with psycopg.connect({services.pg_dsn!r}) as conn:
    Stasher({outbox.qualified!r}).stash(conn, OutboxRecord.of("t", "sync", "1"))
async def main():
    async with await psycopg.AsyncConnection.connect({services.pg_dsn!r}) as conn:
        await AsyncStasher({outbox.qualified!r}).stash(conn, OutboxRecord.of("t", "async", "2"))
asyncio.run(main())
print(json.dumps([tracing() == {{}}, sorted(m for m in sys.modules if "opentelemetry" in m or m == "harvester.otel")]))
"""
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    assert json.loads(out.splitlines()[-1]) == [True, ["opentelemetry"]]  # only the hiding entry
    assert rows(services, outbox) == [("t", "sync", "1", [], []), ("t", "async", "2", [], [])]

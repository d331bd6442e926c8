"""OpenTelemetry trace context through the outbox (the optional ``otel`` extra).

Loaded only when opentelemetry is installed: the stashers take :func:`trace_headers` on their
first stash, the harvester wraps each dispatched batch in :func:`publish_span`. Both ends use the
W3C trace-context format whatever propagator the application configured globally, because the
record's headers are the contract between a stasher and the harvester's consumers.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from contextlib import contextmanager

from opentelemetry import trace
from opentelemetry.trace import Link, NoOpTracerProvider, ProxyTracerProvider, SpanKind
from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator

from harvester.core.records import MarkedRecord

HEADERS = ("traceparent", "tracestate")
_W3C = TraceContextTextMapPropagator()


def trace_headers() -> list[tuple[str, str]]:
    """The W3C headers of the span current now; none when no valid span is current."""
    carrier: dict[str, str] = {}
    _W3C.inject(carrier)
    return [(name, carrier[name]) for name in HEADERS if name in carrier]


def links(batch: Sequence[MarkedRecord]) -> list[Link]:
    """One link per record that carries a valid stashed trace context."""
    out = []
    for record in batch:
        carrier = {
            k: v.decode("utf-8", "replace") if isinstance(v, bytes) else v
            for k, v in record.headers
            if k in HEADERS and v is not None
        }
        if not carrier:
            continue
        context = trace.get_current_span(_W3C.extract(carrier)).get_span_context()
        if context.is_valid:
            out.append(Link(context, {"messaging.message.id": str(record.id)}))
    return out


@contextmanager
def publish_span(batch: Sequence[MarkedRecord]) -> Iterator[None]:
    """A ``publish`` span around dispatching ``batch``, linked to its records' stashed contexts;
    nothing at all until the application configured a tracer provider."""
    provider = trace.get_tracer_provider()
    if isinstance(provider, ProxyTracerProvider | NoOpTracerProvider):
        yield
        return
    topics = {r.topic for r in batch}
    attributes: dict[str, str | int] = {
        "messaging.system": "kafka",
        "messaging.operation.type": "publish",
        "messaging.operation.name": "publish",
        "messaging.batch.message_count": len(batch),
    }
    if len(topics) == 1:
        attributes["messaging.destination.name"] = topics.pop()
    tracer = provider.get_tracer("outbox-harvester")
    with tracer.start_as_current_span("publish", kind=SpanKind.PRODUCER, links=links(batch), attributes=attributes):
        yield

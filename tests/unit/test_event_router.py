"""Debezium's outbox layout in EventRouter's terms: routing, header placements, the options refused,
and a connector's configuration converted into a reaper.yaml (harvester/event_router.py)."""

from __future__ import annotations

import json
from pathlib import Path

import pytest

from harvester.config import HarvesterConfig
from harvester.daemon.cli import main
from harvester.event_router import EventRouter, EventRouterError, Placement, event_router_of, from_connector
from harvester.postgres.log.event_router_rows import roles, trace_context, unreadable

CONNECTOR = {
    "name": "orders-outbox",
    "config": {
        "connector.class": "io.debezium.connector.postgresql.PostgresConnector",
        "database.hostname": "db",
        "database.port": "5432",
        "database.user": "app",
        "database.password": "secret",
        "database.dbname": "shop",
        "topic.prefix": "shop",
        "plugin.name": "pgoutput",
        "table.include.list": "public.outboxevent",
        "transforms": "outbox",
        "transforms.outbox.type": "io.debezium.transforms.outbox.EventRouter",
        "transforms.outbox.table.field.event.key": "aggregate_id",
        "transforms.outbox.route.by.field": "aggregatetype",
        "transforms.outbox.route.topic.replacement": "${routedByValue}.events",
        "transforms.outbox.table.fields.additional.placement": "type:header:eventType,tenant:header",
        "value.converter": "org.apache.kafka.connect.storage.StringConverter",
    },
}


def test_default_routing_and_columns() -> None:
    router = EventRouter()
    assert router.router().topic("Order") == "outbox.event.Order"
    assert router.columns == ("id", "aggregateid", "payload", "aggregatetype")
    assert router.headers == ()


def test_java_regex_and_replacement() -> None:
    options = {"route.topic.regex": r"(?<kind>[a-z]+)_(\d+)", "route.topic.replacement": r"t.${kind}.$2\$"}
    router = event_router_of(options).router()
    assert router.topic("order_12") == "t.order.12$"
    # Not matched whole: the value is the topic, as RegexRouter leaves it.
    assert router.topic("Order_12") == "Order_12"


def test_header_placements_in_their_order() -> None:
    router = event_router_of({"table.fields.additional.placement": "type:header:eventType, tenant:HEADER"})
    assert router.headers == (Placement("type", "eventType"), Placement("tenant", "tenant"))
    assert router.columns[-2:] == ("type", "tenant")


def test_the_last_partition_placement_is_the_partition() -> None:
    router = event_router_of({"table.fields.additional.placement": "a:partition,type:header,b:PARTITION:alias"})
    assert router.headers == (Placement("type", "type"),)
    assert router.partition == "b" and router.places
    assert router.columns[-3:] == ("a", "type", "b")
    # table.fields.additional.error.on.missing false: EventRouter skips a placement whose column is absent.
    optional = event_router_of(
        {"table.fields.additional.placement": "a:partition", "table.fields.additional.error.on.missing": False}
    )
    assert "a" not in optional.columns and optional.partition == "a"
    assert not event_router_of({}).places and event_router_of({"table.field.event.timestamp": "at"}).places


@pytest.mark.parametrize(
    ("options", "error"),
    [
        ({"table.fields.additional.placement": "type:envelope"}, "an envelope makes the value a Connect struct"),
        ({"table.fields.additional.placement": "type:body"}, "placement 'body' is not one of header, partition"),
        ({"table.fields.additional.placement": "type"}, "use column:placement[:alias]"),
        ({"table.expand.json.payload": "true"}, "table.expand.json.payload is not supported"),
        ({"table.field.event.schema.version": "v"}, "table.field.event.schema.version is not supported"),
        ({"route.topic.regex": "(unclosed"}, "route.topic.regex: '(unclosed' is not a regular expression"),
        ({"table.field.event.bogus": "x"}, "table.field.event.bogus: not an EventRouter option"),
    ],
)
def test_unsupported_options_are_one_line_errors(options: dict[str, str], error: str) -> None:
    with pytest.raises(EventRouterError) as caught:
        event_router_of(options)
    assert error in str(caught.value) and "\n" not in str(caught.value)


def test_layout_needs_the_log_source() -> None:
    with pytest.raises(ValueError, match="layout 'debezium' is read by source 'log': mark_purge orders"):
        HarvesterConfig.model_validate({"layout": "debezium"})
    with pytest.raises(ValueError, match="layout 'debezium' is a table: it cannot be read with logMessages"):
        HarvesterConfig.model_validate({"layout": "debezium", "source": "log", "logMessages": True})
    with pytest.raises(ValueError, match="eventRouter needs layout 'debezium'"):
        HarvesterConfig.model_validate({"eventRouter": {}})


def test_layout_defaults_to_javas_partitioner() -> None:
    config = HarvesterConfig.model_validate({"source": "log", "layout": "debezium"})
    assert config.event_router == EventRouter()
    assert config.producer_kafka_config == {"partitioner": "murmur2_random"}
    chosen = {"source": "log", "layout": "debezium", "producerKafkaConfig": {"partitioner": "consistent"}}
    assert HarvesterConfig.model_validate(chosen).producer_kafka_config == {"partitioner": "consistent"}


def test_a_connector_converts_one_to_one() -> None:
    harvest = from_connector(CONNECTOR)
    assert harvest == {
        "dataSource": "host=db port=5432 user=app dbname=shop password=${env:PGPASSWORD}",
        "outboxTable": "public.outboxevent",
        "source": "log",
        "layout": "debezium",
        "eventRouter": {
            "table.field.event.key": "aggregate_id",
            "route.by.field": "aggregatetype",
            "route.topic.replacement": "${routedByValue}.events",
            "table.fields.additional.placement": "type:header:eventType,tenant:header",
        },
    }
    config = HarvesterConfig.model_validate(harvest)
    assert config.event_router is not None and config.event_router.event_key == "aggregate_id"


@pytest.mark.parametrize(
    ("change", "error"),
    [
        ({"value.converter": "io.confluent.connect.avro.AvroConverter"}, "only StringConverter and ByteArrayConverter"),
        ({"transforms": "outbox,route", "transforms.route.type": "x.Y"}, "transform route (x.Y) has no counterpart"),
        ({"transforms": ""}, "0 transforms of type io.debezium.transforms.outbox.EventRouter"),
        ({"table.include.list": "public.a,public.b"}, "names 2 tables"),
        ({"table.include.list": "public.outbox.*"}, "is a pattern"),
        ({"connector.class": "io.debezium.connector.mysql.MySqlConnector"}, "only Debezium's PostgresConnector"),
    ],
)
def test_connectors_not_converted(change: dict[str, str], error: str) -> None:
    connector = {**CONNECTOR, "config": {**CONNECTOR["config"], **change}}  # type: ignore[dict-item]
    with pytest.raises(EventRouterError, match=error.replace("(", r"\(").replace(")", r"\)").replace(".*", r"\.\*")):
        from_connector(connector)


def test_convert_command(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    path = tmp_path / "connector.json"
    path.write_text(json.dumps(CONNECTOR))
    assert main(["convert-debezium", str(path)]) == 0
    printed = capsys.readouterr().out
    assert 'layout: "debezium"' in printed and 'route.topic.replacement: "${routedByValue}.events"' in printed
    path.write_text("{")
    assert main(["convert-debezium", str(path)]) == 2
    assert capsys.readouterr().err.startswith("reaper: convert-debezium: not JSON:")


def test_the_tracing_span_context_of_java_properties() -> None:
    text = b"#Sat Nov 28 04:00:00 UTC 2026\ntraceparent=00-0af7-b7ad-01\ntracestate=rojo\\=00f0\\:1\nother=1\n!x\n"
    assert trace_context(text) == [("traceparent", b"00-0af7-b7ad-01"), ("tracestate", b"rojo=00f0:1")]
    assert trace_context(b"") == []


def test_placed_columns_of_a_type_eventrouter_does_not_read_are_named() -> None:
    router = event_router_of(
        {"table.fields.additional.placement": "shard:partition,tag:header", "table.field.event.timestamp": "at"}
    )
    text, uuid = 25, 2950
    table = {"id": uuid, "aggregateid": text, "payload": text, "aggregatetype": text, "tag": text}
    problems = [unreadable(r, {**table, "shard": 20, "at": text}, "s.t") for r in roles(router, table)]
    assert [p for p in problems if p] == [
        "the log source cannot read at (table.field.event.timestamp) of type oid 25:"
        " it must be timestamp or timestamptz",
        "the log source cannot read shard (table.fields.additional.placement partition) of type oid 20:"
        " it must be integer",
    ]
    assert [unreadable(r, {**table, "shard": 23, "at": 1184}, "s.t") for r in roles(router, table)] == [None] * 7
    # table.fields.additional.error.on.missing false: a placed column the table lacks is not read.
    optional = event_router_of({**router.model_dump(by_alias=True), "table.fields.additional.error.on.missing": False})
    assert [r[0] for r in roles(optional, table)] == ["id", "aggregateid", "payload", "aggregatetype", "tag", "at"]

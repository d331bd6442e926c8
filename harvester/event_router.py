"""Debezium's outbox layout (``layout: debezium``): the table its ``EventRouter`` transform reads,
and how that transform makes a Kafka record of a row, in the transform's own option names, so that a
connector's ``transforms.<name>.*`` properties carry over one to one (:func:`from_connector`).

What a row becomes, as EventRouter makes it with Kafka Connect's ``StringConverter`` (or
``ByteArrayConverter`` for a bytea payload): the topic is the ``route.by.field`` column's value
rewritten by ``route.topic.regex`` and ``route.topic.replacement`` when the regex matches it whole
(Kafka Connect's ``RegexRouter``), the key is the ``table.field.event.key`` column, the value the
``table.field.event.payload`` column (a tombstone for an empty one with
``route.tombstone.on.empty.payload``), and the headers are ``id`` (the ``table.field.event.id``
column) then each ``table.fields.additional.placement`` column placed as a header, in that order. A
column placed as the partition (an integer column; the last such placement) is the record's
partition, and the ``table.field.event.timestamp`` column its timestamp. Only inserts are records: a
delete (the framework extensions delete the row in the transaction that inserted it) is none.

Options whose output this project does not reproduce (an envelope, an expanded JSON payload) are
refused, one line each (:class:`EventRouterError`).
"""

from __future__ import annotations

import json
import re
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

EVENT_ROUTER = "io.debezium.transforms.outbox.EventRouter"

# Options EventRouter has whose output is not reproduced here, and why (one line each).
UNSUPPORTED = {
    "table.expand.json.payload": "an expanded JSON payload is a Connect struct the value converter writes",
    "table.field.event.schema.version": "a schema version applies to the envelope, which is not supported",
    "table.json.payload.null.behavior": "it applies to an expanded JSON payload, which is not supported",
}
# The converters whose output the reaper reproduces (a JSON or Avro converter wraps the value).
_VALUE_CONVERTERS = {
    "org.apache.kafka.connect.storage.StringConverter",
    "org.apache.kafka.connect.converters.ByteArrayConverter",
}


class EventRouterError(ValueError):
    """An EventRouter option or connector configuration this project cannot reproduce (one line)."""


@dataclass(frozen=True, slots=True)
class Placement:
    """One ``table.fields.additional.placement`` entry: a column placed as a header (named ``header``)
    or as the partition."""

    column: str
    header: str
    kind: Literal["header", "partition"] = "header"


# Why an envelope placement is refused: EventRouter then makes the value a Connect struct of the
# payload and the placed columns, which StringConverter writes as Struct{payload=...} (Java's
# toString, not a format a consumer parses) and ByteArrayConverter refuses; a consumer reads one only
# through a JSON or Avro converter, whose output this project does not reproduce.
_ENVELOPE = (
    "an envelope makes the value a Connect struct, which only a JSON or Avro converter writes as"
    " consumers read it (not reproduced: place the column as a header)"
)


class EventRouter(BaseModel):
    """The ``eventRouter:`` block of a ``harvest:`` section: EventRouter's options, by its names."""

    model_config = ConfigDict(extra="forbid", frozen=True, populate_by_name=True)

    event_id: str = Field(default="id", alias="table.field.event.id")
    event_key: str = Field(default="aggregateid", alias="table.field.event.key")
    # Read by EventRouter for nothing but an additional placement; accepted so that a connector's
    # configuration carries over.
    event_type: str = Field(default="type", alias="table.field.event.type")
    event_payload: str = Field(default="payload", alias="table.field.event.payload")
    event_timestamp: str | None = Field(default=None, alias="table.field.event.timestamp")
    additional_placement: str = Field(default="", alias="table.fields.additional.placement")
    additional_error_on_missing: bool = Field(default=True, alias="table.fields.additional.error.on.missing")
    route_by_field: str = Field(default="aggregatetype", alias="route.by.field")
    route_topic_regex: str = Field(default="(?<routedByValue>.*)", alias="route.topic.regex")
    route_topic_replacement: str = Field(default="outbox.event.${routedByValue}", alias="route.topic.replacement")
    route_tombstone_on_empty_payload: bool = Field(default=False, alias="route.tombstone.on.empty.payload")
    # Updates never reach the log source (its publication publishes inserts only).
    op_invalid_behavior: Literal["warn", "error", "fatal"] = Field(default="warn", alias="debezium.op.invalid.behavior")
    # Tracing: a tracing span context column is read like any other column; see docs/migrating.md.
    tracing_span_context_field: str = Field(default="tracingspancontext", alias="tracing.span.context.field")
    tracing_operation_name: str = Field(default="debezium-read", alias="tracing.operation.name")
    tracing_with_context_field_only: bool = Field(default=False, alias="tracing.with.context.field.only")

    @model_validator(mode="before")
    @classmethod
    def _supported(cls, data: Any) -> Any:
        if isinstance(data, Mapping):
            for option, why in UNSUPPORTED.items():
                if option in data and str(data[option]).lower() not in ("", "false", "ignore"):
                    raise ValueError(f"EventRouter option {option} is not supported: {why}")
        return data

    @field_validator("route_topic_regex")
    @classmethod
    def _regex(cls, value: str) -> str:
        try:
            re.compile(python_regex(value))
        except re.error as exc:
            raise ValueError(f"{value!r} is not a regular expression this project reads: {exc}") from None
        return value

    @field_validator("additional_placement")
    @classmethod
    def _placement(cls, value: str) -> str:
        parse_placements(value)
        return value

    @property
    def headers(self) -> tuple[Placement, ...]:
        """The additional columns placed as headers, in their order."""
        return tuple(p for p in parse_placements(self.additional_placement) if p.kind == "header")

    @property
    def partition(self) -> str | None:
        """The column placed as the partition: the last such placement, as EventRouter sets each in turn."""
        partitions = [p.column for p in parse_placements(self.additional_placement) if p.kind == "partition"]
        return partitions[-1] if partitions else None

    @property
    def columns(self) -> tuple[str, ...]:
        """The columns a record is made of that the table must have: id, key, payload, routing,
        timestamp, and the placed columns unless ``table.fields.additional.error.on.missing`` is
        false (EventRouter then skips a placement whose column is absent)."""
        named = [self.event_id, self.event_key, self.event_payload, self.route_by_field]
        if self.event_timestamp:
            named.append(self.event_timestamp)
        if self.additional_error_on_missing:
            named += [p.column for p in parse_placements(self.additional_placement)]
        return tuple(dict.fromkeys(named))

    @property
    def places(self) -> bool:
        """Whether records get a timestamp or a partition of their own."""
        return self.event_timestamp is not None or self.partition is not None

    def router(self) -> Router:
        """The topic router of these options."""
        regex = re.compile(python_regex(self.route_topic_regex))
        return Router(regex, python_replacement(self.route_topic_replacement))


def parse_placements(value: str) -> tuple[Placement, ...]:
    """``table.fields.additional.placement``: ``column:placement[:alias]`` entries, comma-separated."""
    out: list[Placement] = []
    for entry in (e.strip() for e in value.split(",")):
        if not entry:
            continue
        parts = entry.split(":")
        if len(parts) not in (2, 3) or not parts[0]:
            raise ValueError(f"entry {entry!r}: use column:placement[:alias]")
        placement = parts[1].strip().lower()
        if placement == "envelope":
            raise ValueError(f"entry {entry!r}: {_ENVELOPE}")
        if placement not in ("header", "partition"):
            raise ValueError(f"entry {entry!r}: placement {placement!r} is not one of header, partition, envelope")
        kind: Literal["header", "partition"] = "header" if placement == "header" else "partition"
        out.append(Placement(parts[0], parts[2] if len(parts) == 3 else parts[0], kind))
    return tuple(out)


@dataclass(frozen=True, slots=True)
class Router:
    """Kafka Connect's ``RegexRouter`` as EventRouter configures it: a value the regex matches whole
    is replaced, any other is the topic as it is."""

    regex: re.Pattern[str]
    replacement: str

    def topic(self, value: str) -> str:
        match = self.regex.fullmatch(value)
        return match.expand(self.replacement) if match is not None else value


def python_regex(java: str) -> str:
    """A Java regular expression's named groups in Python's spelling (the rest is common ground)."""
    return re.sub(r"\(\?<([A-Za-z][A-Za-z0-9]*)>", r"(?P<\1>", java)


def python_replacement(java: str) -> str:
    """A Java ``Matcher`` replacement (``${name}``, ``$1``, ``\\$``) as a Python ``expand`` template."""
    out: list[str] = []
    i = 0
    while i < len(java):
        c = java[i]
        if c == "\\" and i + 1 < len(java):
            out.append(java[i + 1].replace("\\", "\\\\"))
            i += 2
        elif c == "$" and java.startswith("{", i + 1) and "}" in java[i:]:
            end = java.index("}", i)
            out.append(f"\\g<{java[i + 2 : end]}>")
            i = end + 1
        elif c == "$" and i + 1 < len(java) and java[i + 1].isdigit():
            j = i + 1
            while j < len(java) and java[j].isdigit():
                j += 1
            out.append(f"\\g<{java[i + 1 : j]}>")
            i = j
        else:
            out.append(c)
            i += 1
    return "".join(out)


# ---------------------------------------------------------------- a connector's configuration


def event_router_of(options: Mapping[str, Any]) -> EventRouter:
    """Validate an ``eventRouter:`` block; raises :class:`EventRouterError` (one line)."""
    try:
        return EventRouter.model_validate(dict(options))
    except ValidationError as exc:
        error = exc.errors()[0]
        where = ".".join(str(p) for p in error["loc"])
        message = str(error["msg"]).removeprefix("Value error, ")
        if error["type"] == "extra_forbidden":
            message = "not an EventRouter option this project knows"
        raise EventRouterError(f"{where}: {message}" if where else message) from None


def from_connector(connector: Mapping[str, Any]) -> dict[str, Any]:
    """The ``harvest:`` section of a ``reaper.yaml`` that reads what a Debezium PostgreSQL connector
    with an EventRouter reads (``connector``: its JSON, ``{"name":…, "config":{…}}`` or the config
    alone). Its own slot and publication (the connector's stay its own, for the hand-over,
    docs/migrating.md). Raises :class:`EventRouterError`."""
    config = connector.get("config", connector)
    if not isinstance(config, Mapping):
        raise EventRouterError("the connector's configuration is not a JSON object")
    kind = str(config.get("connector.class", ""))
    if kind != "io.debezium.connector.postgresql.PostgresConnector":
        raise EventRouterError(f"connector.class {kind or '(none)'}: only Debezium's PostgresConnector is converted")
    names = [n.strip() for n in str(config.get("transforms", "")).split(",") if n.strip()]
    routers = [n for n in names if config.get(f"transforms.{n}.type") == EVENT_ROUTER]
    if len(routers) != 1:
        raise EventRouterError(f"the connector has {len(routers)} transforms of type {EVENT_ROUTER}; one is converted")
    others = [n for n in names if n not in routers]
    if others:
        other = config.get(f"transforms.{others[0]}.type")
        raise EventRouterError(f"transform {others[0]} ({other}) has no counterpart")
    for which in ("value.converter", "key.converter"):
        converter = config.get(which)
        if converter is not None and converter not in _VALUE_CONVERTERS:
            raise EventRouterError(f"{which} {converter}: only StringConverter and ByteArrayConverter carry over")
    tables = [t.strip() for t in str(config.get("table.include.list", "")).split(",") if t.strip()]
    if len(tables) != 1:
        raise EventRouterError(f"table.include.list names {len(tables)} tables; name the one outbox table")
    if re.search(r"[\\^$*+?()\[\]{}|]", tables[0]):
        raise EventRouterError(f"table.include.list {tables[0]!r} is a pattern; name the outbox table")
    prefix = f"transforms.{routers[0]}."
    options = {k[len(prefix) :]: v for k, v in config.items() if k.startswith(prefix) and k != prefix + "type"}
    router = event_router_of(options)
    source = {
        "host": config.get("database.hostname"),
        "port": config.get("database.port"),
        "user": config.get("database.user"),
        "dbname": config.get("database.dbname"),
    }
    dsn = " ".join(f"{k}={v}" for k, v in source.items() if v not in (None, ""))
    if config.get("database.password") is not None:
        dsn += " password=${env:PGPASSWORD}"
    return {
        "dataSource": dsn,
        "outboxTable": tables[0],
        "source": "log",
        "layout": "debezium",
        "eventRouter": router.model_dump(by_alias=True, exclude_unset=True),
    }


def converted_yaml(connector_json: str) -> str:
    """:func:`from_connector` of a connector's JSON text, as the text of a ``reaper.yaml``."""
    try:
        connector = json.loads(connector_json)
    except json.JSONDecodeError as exc:
        raise EventRouterError(f"not JSON: {exc}") from None
    if not isinstance(connector, Mapping):
        raise EventRouterError("the connector's JSON is not an object")
    harvest = from_connector(connector)
    lines = [
        "# Converted from Debezium connector " + json.dumps(str(connector.get("name", "(unnamed)"))),
        "# Kafka: the worker's bootstrap.servers, which the connector's configuration does not hold.",
        "harvest:",
    ]
    for key, value in harvest.items():
        if isinstance(value, dict):
            lines.append(f"  {key}:" + (" {}" if not value else ""))
            lines += [f"    {k}: {json.dumps(v)}" for k, v in value.items()]
        else:
            lines.append(f"  {key}: {json.dumps(value)}")
    lines += ["  baseKafkaConfig:", '    bootstrap.servers: "127.0.0.1:9092"']
    return "\n".join(lines) + "\n"

"""What one write through the ``outbox`` data source needs to know, resolved on the driver.

:func:`resolve` turns the user's options and the DataFrame's schema into a :class:`WritePlan`,
checking everything that can be checked before a single row moves: the options, the column
types, a constant topic, and the outbox table's column types read from the catalog. The plan is
pickled to every executor and to the commit, so it holds plain values only.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Literal

from pyspark.sql.types import (
    ArrayType,
    BinaryType,
    ByteType,
    DataType,
    DateType,
    IntegerType,
    LongType,
    MapType,
    ShortType,
    StringType,
    StructType,
    TimestampNTZType,
    TimestampType,
)

from harvester.core.records import RecordError, check_topic
from harvester.postgres.schema.catalog import OutboxColumns
from harvester.postgres.schema.identifiers import TableName

SortKind = Literal["number", "text"]
HeadersKind = Literal["map", "pairs"]

_WORK_MEM = re.compile(r"^[1-9][0-9]{0,6}(kB|MB|GB)$")


class SinkConfigError(ValueError):
    """The ``outbox`` data source's options are missing or inconsistent."""


@dataclass(frozen=True, slots=True)
class WritePlan:
    """Everything executors and the commit need for one write (batch job or streaming query)."""

    dsn: str
    table: TableName
    topic: str | None
    topic_column: str | None
    key_column: str
    value_column: str
    headers_column: str | None
    headers_kind: HeadersKind | None
    order_column: str | None
    sort_kind: SortKind | None
    columns: OutboxColumns
    commit_sql: str | None
    work_mem: str
    retention_seconds: int
    sink_id: str | None
    write_id: str = field(default_factory=lambda: str(uuid.uuid4()))


def _option(options: Mapping[str, str], name: str) -> str | None:
    value = options.get(name)
    return value if value not in (None, "") else None


def _require_column(schema: StructType, name: str, role: str) -> DataType:
    if name not in schema.fieldNames():
        raise RecordError(
            f"the DataFrame has no {role} column {name!r} (columns: {', '.join(schema.fieldNames())}); "
            f"set the {role}Column option or add the column"
        )
    data_type: DataType = schema[name].dataType
    return data_type


def _is_text_or_bytes(data_type: DataType) -> bool:
    return isinstance(data_type, StringType | BinaryType)


def _headers_kind(data_type: DataType, name: str) -> HeadersKind:
    if (
        isinstance(data_type, MapType)
        and isinstance(data_type.keyType, StringType)
        and _is_text_or_bytes(data_type.valueType)
    ):
        return "map"
    if isinstance(data_type, ArrayType) and isinstance(data_type.elementType, StructType):
        fields = data_type.elementType.fields
        if len(fields) == 2 and isinstance(fields[0].dataType, StringType) and _is_text_or_bytes(fields[1].dataType):
            return "pairs"
    raise RecordError(
        f"headers column {name!r} has type {data_type.simpleString()}; expected map<string,string> or "
        "array<struct<key:string,value:string>>"
    )


def _sort_kind(data_type: DataType, name: str) -> SortKind:
    numeric = ByteType | ShortType | IntegerType | LongType | DateType | TimestampType | TimestampNTZType
    if isinstance(data_type, numeric):
        return "number"
    if isinstance(data_type, StringType):
        return "text"
    raise RecordError(
        f"order column {name!r} has type {data_type.simpleString()}; expected an integer, date, timestamp "
        "or string column"
    )


def resolve(
    options: Mapping[str, str],
    schema: StructType,
    describe: Callable[[str, TableName, int], OutboxColumns],
    streaming: bool,
) -> WritePlan:
    """Check ``options`` against ``schema`` and the outbox table; raise before any row is written.

    ``describe(dsn, table, retention_seconds)`` reads the outbox's column types (and may create the
    sink's tables and clean up stale staged rows).
    """
    dsn = _option(options, "dsn")
    if dsn is None:
        raise SinkConfigError("option 'dsn' (a libpq connection string) is required")
    table = TableName.parse(_option(options, "table") or "outbox")
    topic, topic_column = _option(options, "topic"), _option(options, "topicColumn")
    if (topic is None) == (topic_column is None):
        raise SinkConfigError("set exactly one of the options 'topic' (a constant) and 'topicColumn'")
    if topic is not None:
        check_topic(topic)
    if topic_column is not None and not isinstance(_require_column(schema, topic_column, "topic"), StringType):
        raise RecordError(f"topic column {topic_column!r} must be a string column")

    key_column = _option(options, "keyColumn") or "key"
    key_type = _require_column(schema, key_column, "key")
    if not _is_text_or_bytes(key_type):
        raise RecordError(
            f"key column {key_column!r} has type {key_type.simpleString()}; expected string or binary "
            "(cast it to string)"
        )
    value_column = _option(options, "valueColumn") or "value"
    value_type = _require_column(schema, value_column, "value")
    if not _is_text_or_bytes(value_type):
        raise RecordError(
            f"value column {value_column!r} has unsupported type {value_type.simpleString()}; expected string "
            "or binary (serialise it first, e.g. with to_json)"
        )

    headers_column = _option(options, "headersColumn")
    headers_kind = None
    if headers_column is not None:
        headers_kind = _headers_kind(_require_column(schema, headers_column, "headers"), headers_column)
    order_column = _option(options, "orderColumn")
    sort_kind = None
    if order_column is not None:
        sort_kind = _sort_kind(_require_column(schema, order_column, "order"), order_column)

    work_mem = _option(options, "commitWorkMem") or "256MB"
    if not _WORK_MEM.match(work_mem):
        raise SinkConfigError(f"option 'commitWorkMem' must look like 64MB or 1GB, not {work_mem!r}")
    retention = _option(options, "stagingRetentionSeconds") or "86400"
    if not retention.isdigit() or int(retention) < 60:
        raise SinkConfigError("option 'stagingRetentionSeconds' must be a whole number of seconds, at least 60")
    sink_id = _option(options, "sinkId")
    if streaming and sink_id is None:
        raise SinkConfigError(
            "option 'sinkId' is required for streaming writes: it names the query in the commit table, "
            "so that a micro-batch replayed from the checkpoint is recognised"
        )
    columns = describe(dsn, table, int(retention))
    return WritePlan(
        dsn=dsn,
        table=table,
        topic=topic,
        topic_column=topic_column,
        key_column=key_column,
        value_column=value_column,
        headers_column=headers_column,
        headers_kind=headers_kind,
        order_column=order_column,
        sort_kind=sort_kind,
        columns=columns,
        commit_sql=_option(options, "commitSql"),
        work_mem=work_mem,
        retention_seconds=int(retention),
        sink_id=sink_id,
    )

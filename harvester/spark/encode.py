"""Executor side: turns Arrow record batches into CSV for ``COPY … FROM STDIN`` into the staging table.

Every check and conversion is a vectorised Arrow kernel, and the CSV is written by Arrow's C++
writer, so a partition costs no Python work per row (except binary values bound for a BYTEA
column, which are hex-encoded one by one).
"""

from __future__ import annotations

import io
from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.csv as pcsv

from harvester.record import RecordError
from harvester.spark.plan import WritePlan

# Row numbers within a partition take the low 40 bits of seq, the partition id the rest, so that
# ORDER BY seq is the DataFrame's order: partition by partition, row by row.
PARTITION_SHIFT = 40
_TOPIC_PATTERN = r"^[A-Za-z0-9._-]{1,249}$"
_CSV = pcsv.WriteOptions(include_header=False, quoting_style="needed")


def staging_columns(plan: WritePlan) -> list[str]:
    """The staging columns the executors' COPY fills for ``plan``, in CSV order."""
    columns = ["task_id", "seq"]
    if plan.sort_kind is not None:
        columns.append("sort_number" if plan.sort_kind == "number" else "sort_text")
    if plan.topic_column is not None:
        columns.append("kafka_topic")
    columns += ["kafka_key", "value_bytes" if plan.columns.limits.value_kind == "bytes" else "value_text"]
    if plan.headers_column is not None:
        columns += ["header_keys", "header_values"]
    return columns


def _sample(values: Any, mask: Any) -> str:
    first = pc.index(mask, True).as_py()
    return repr(values[first].as_py())[:80]


def _as_text(values: Any, what: str) -> Any:
    """Binary columns are accepted when they hold UTF-8; the cast checks that."""
    if pa.types.is_binary(values.type) or pa.types.is_large_binary(values.type):
        try:
            return values.cast(pa.large_string())
        except pa.ArrowInvalid as exc:
            raise RecordError(f"{what} is not valid UTF-8 and the outbox column is textual") from exc
    return values


def _no_nul(values: Any, what: str) -> None:
    mask = pc.match_substring(values, "\x00")
    if pc.any(mask).as_py():
        raise RecordError(
            f"{what} contains a NUL character, which PostgreSQL text cannot hold: {_sample(values, mask)}"
        )


def _max_chars(values: Any, limit: int | None, what: str) -> None:
    if limit is None or len(values) == 0:
        return
    lengths = pc.utf8_length(values)
    mask = pc.greater(lengths, limit)
    if pc.any(mask).as_py():
        longest = pc.max(lengths).as_py()
        raise RecordError(
            f"{what} of {longest} characters does not fit the outbox column ({limit} at most): {_sample(values, mask)}"
        )


def _not_null(values: Any, what: str) -> None:
    if values.null_count:
        raise RecordError(f"{what} must not be null")


def _topics(values: Any) -> Any:
    _not_null(values, "a topic")
    bad = pc.or_(
        pc.invert(pc.match_substring_regex(values, _TOPIC_PATTERN)),
        pc.is_in(values, value_set=pa.array([".", ".."], values.type)),
    )
    if pc.any(bad).as_py():
        raise RecordError(
            f"invalid Kafka topic name {_sample(values, bad)}: 1-249 characters of letters, digits, '.', '_' or '-'"
        )
    return values


def _array_literals(offsets: Any, elements: Any, what: str) -> Any:
    """PostgreSQL array literals (``{"a","b"}``) for lists given as offsets into ``elements``."""
    _not_null(elements, what)
    _no_nul(elements, what)
    escaped = pc.replace_substring(pc.replace_substring(elements, "\\", "\\\\"), '"', '\\"')
    quoted = pc.binary_join_element_wise('"', escaped, '"', "")
    joined = pc.binary_join(pa.ListArray.from_arrays(offsets, quoted), ",")
    return pc.binary_join_element_wise("{", joined, "}", "")


def _headers(plan: WritePlan, column: Any) -> tuple[Any, Any]:
    if isinstance(column, pa.ChunkedArray):
        column = column.combine_chunks()
    if plan.headers_kind == "map":
        keys, values = column.keys, column.items
    else:
        keys, values = column.values.field(0), column.values.field(1)
    keys = _as_text(keys, "a header key")
    values = _as_text(values, "a header value")
    offsets = column.offsets
    return _array_literals(offsets, keys, "a header key"), _array_literals(offsets, values, "a header value")


def _sort_values(plan: WritePlan, column: Any) -> Any:
    if plan.sort_kind == "text":
        return column
    if pa.types.is_timestamp(column.type):
        return column.cast(pa.timestamp("us")).cast(pa.int64())
    if pa.types.is_date(column.type):
        return column.cast(pa.int32()).cast(pa.int64())
    return column.cast(pa.int64())


def _hex_bytea(values: Any) -> Any:
    """BYTEA input syntax (``\\x…``); Arrow has no hex kernel, so this one loops in Python."""
    return pa.array([None if v is None else "\\x" + v.hex() for v in values.to_pylist()], pa.string())


class PartitionEncoder:
    """Encodes one partition's batches, numbering rows in arrival order."""

    def __init__(self, plan: WritePlan, partition_id: int) -> None:
        self._plan = plan
        self._base = partition_id << PARTITION_SHIFT
        self.rows = 0

    def _value(self, column: Any) -> Any:
        limits = self._plan.columns.limits
        if limits.value_kind == "bytes":
            if pa.types.is_string(column.type) or pa.types.is_large_string(column.type):
                column = column.cast(pa.large_binary())
            return _hex_bytea(column)
        column = _as_text(column, "a value")
        _no_nul(column, "a value")
        _max_chars(column, limits.value_max_chars, "a value")
        return column

    def encode(self, batch: pa.RecordBatch, task_id: int) -> bytes:
        """The CSV for ``batch``; raise :class:`RecordError` if any row cannot go to the outbox."""
        plan, n = self._plan, batch.num_rows
        key = _as_text(batch.column(plan.key_column), "a key")
        _not_null(key, "a key")
        _no_nul(key, "a key")
        _max_chars(key, plan.columns.limits.key_max_chars, "a key")
        seq = np.arange(self._base + self.rows, self._base + self.rows + n, dtype=np.int64)
        columns: list[Any] = [pa.array(np.full(n, task_id, dtype=np.int64)), pa.array(seq)]
        if plan.order_column is not None:
            columns.append(_sort_values(plan, batch.column(plan.order_column)))
        if plan.topic_column is not None:
            columns.append(_topics(batch.column(plan.topic_column)))
        columns += [key, self._value(batch.column(plan.value_column))]
        if plan.headers_column is not None:
            columns += list(_headers(plan, batch.column(plan.headers_column)))
        names = [f"c{i}" for i in range(len(columns))]
        out = io.BytesIO()
        pcsv.write_csv(pa.Table.from_arrays(columns, names=names), out, _CSV)
        self.rows += n
        return out.getvalue()

"""Executor side: turns Arrow record batches into PostgreSQL's text COPY format for the staging table.

Every check, conversion and escape is a vectorised Arrow kernel, and the lines are joined in C++,
so a partition costs no Python work per row (except binary values bound for a BYTEA column, which
are hex-encoded one by one). The text format, rather than CSV, because PostgreSQL parses it faster.
"""

from __future__ import annotations

from typing import Any

import numpy as np
import pyarrow as pa
import pyarrow.compute as pc

from harvester.core.records import RecordError
from harvester.spark.plan import WritePlan

# Row numbers within a partition take the low 40 bits of seq, the partition id the rest, so that
# ORDER BY seq is the DataFrame's order: partition by partition, row by row.
PARTITION_SHIFT = 40
_TOPIC_PATTERN = r"^[A-Za-z0-9._-]{1,249}$"
# The text format's escapes (backslash first, so that the others are not doubled) and NULL marker.
_ESCAPES = (("\\", "\\\\"), ("\t", "\\t"), ("\n", "\\n"), ("\r", "\\r"))
# One scan finds what needs a closer look: NUL (refused) and what the text format escapes.
_SPECIAL = r"[\x00\\\t\n\r]"
_NULL = pa.scalar("\\N", pa.large_string())
_TAB = pa.scalar("\t", pa.large_string())
_NEWLINE = pa.scalar("\n", pa.large_string())
_NOTHING = pa.scalar("", pa.large_string())


def staged_value_column(plan: WritePlan) -> str:
    """The staging column that holds the values of ``plan``: bytes for a BYTEA outbox, else text."""
    return "value_bytes" if plan.columns.limits.value_kind == "bytes" else "value_text"


def staging_columns(plan: WritePlan) -> list[str]:
    """The staging columns the executors' COPY fills for ``plan``, in line order."""
    columns = ["task_id", "seq"]
    if plan.sort_kind is not None:
        columns.append("sort_number" if plan.sort_kind == "number" else "sort_text")
    if plan.topic_column is not None:
        columns.append("kafka_topic")
    columns += ["kafka_key", staged_value_column(plan)]
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
    # Bytes bound characters from above, and counting bytes needs no decoding.
    if limit is None or len(values) == 0 or (pc.max(pc.binary_length(values)).as_py() or 0) <= limit:
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
    """PostgreSQL array literals (``{"a","b"}``) for lists given as offsets into ``elements``; a NUL
    in an element is refused when the literal is escaped for COPY."""
    _not_null(elements, what)
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


def _escaped(values: Any, what: str) -> Any:
    """Text values as text-format fields: NUL refused, escapes applied, NULL as ``\\N``."""
    if pc.any(pc.match_substring_regex(values, _SPECIAL)).as_py():
        _no_nul(values, what)
        for old, new in _ESCAPES:
            values = pc.replace_substring(values, old, new)
    return _with_nulls(values.cast(pa.large_string()))


def _with_nulls(text: Any) -> Any:
    return pc.fill_null(text, _NULL) if text.null_count else text


def _decimal(numbers: Any) -> Any:
    """Non-negative integers as zero-padded decimal text, computed digit by digit over the whole
    array: Arrow's cast to string formats one value at a time and costs several times more."""
    width = len(str(int(numbers.max())))
    powers = 10 ** np.arange(width - 1, -1, -1, dtype=np.int64)
    digits = (numbers[:, None] // powers % 10 + ord("0")).astype(np.uint8)
    offsets = np.arange(0, (len(numbers) + 1) * width, width, dtype=np.int64)
    return pa.LargeStringArray.from_buffers(len(numbers), pa.py_buffer(offsets), pa.py_buffer(digits))


def text_lines(fields: list[Any]) -> bytes:
    """``COPY … FROM STDIN`` text-format lines from columns of fields (large strings, or a scalar
    that every line repeats)."""
    lines = pc.binary_join_element_wise(*fields, _TAB)
    lines = pc.binary_join_element_wise(lines, _NEWLINE, _NOTHING)
    _, offsets, data = lines.buffers()
    bounds = np.frombuffer(offsets, dtype=np.int64)
    return bytes(data[bounds[lines.offset] : bounds[lines.offset + len(lines)]])


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
            return _escaped(_hex_bytea(column), "a value")
        column = _as_text(column, "a value")
        _max_chars(column, limits.value_max_chars, "a value")
        return _escaped(column, "a value")

    def encode(self, batch: pa.RecordBatch, task_id: int) -> bytes:
        """The COPY lines for ``batch``; raise :class:`RecordError` if any row cannot go to the outbox."""
        plan, n = self._plan, batch.num_rows
        key = _as_text(batch.column(plan.key_column), "a key")
        _not_null(key, "a key")
        _max_chars(key, plan.columns.limits.key_max_chars, "a key")
        seq = np.arange(self._base + self.rows, self._base + self.rows + n, dtype=np.int64)
        fields: list[Any] = [pa.scalar(str(task_id), pa.large_string()), _decimal(seq)]
        if plan.order_column is not None:
            sort = _sort_values(plan, batch.column(plan.order_column))
            textual = plan.sort_kind == "text"
            fields.append(_escaped(sort, "an ordering value") if textual else _with_nulls(sort.cast(pa.large_string())))
        if plan.topic_column is not None:
            fields.append(_escaped(_topics(batch.column(plan.topic_column)), "a topic"))
        fields += [_escaped(key, "a key"), self._value(batch.column(plan.value_column))]
        if plan.headers_column is not None:
            keys, values = _headers(plan, batch.column(plan.headers_column))
            fields += [_escaped(keys, "a header key"), _escaped(values, "a header value")]
        self.rows += n
        return text_lines(fields)

"""Checks on an outbox row before it becomes a Kafka message, shared by both record sources (the
mark-purge/reset store and the log source) and, as SQL, by the Spark drain's plan."""

from __future__ import annotations

from collections.abc import Sequence, Sized
from typing import NamedTuple

from psycopg import sql

MALFORMED_SQL = sql.SQL(
    "CASE WHEN kafka_key IS NULL THEN 'kafka_key is NULL'"
    " WHEN kafka_header_keys IS NULL OR kafka_header_values IS NULL THEN 'header arrays are NULL'"
    " WHEN cardinality(kafka_header_keys) <> cardinality(kafka_header_values)"
    " THEN cardinality(kafka_header_keys) || ' header keys but '"
    " || cardinality(kafka_header_values) || ' header values'"
    " WHEN array_position(kafka_header_keys, NULL) IS NOT NULL THEN 'a header key is NULL' END"
)
""":func:`malformed` of an outbox row as an SQL expression: the same reason, or NULL."""


class Pending(NamedTuple):
    """A record a mark would hand out, as the Spark drain plans it: without its value."""

    id: int
    malformed: str | None  # why no message can be made of it (:func:`malformed`), or None
    topic: str | None
    size: int  # bytes of its key, value and headers (with their length varints), before the identity headers


def malformed(key: str | None, hkeys: Sequence[object] | None, hvalues: Sized | None) -> str | None:
    """Why a row cannot become a Kafka message, or None when it can."""
    if key is None:
        return "kafka_key is NULL"
    if hkeys is None or hvalues is None:
        return "header arrays are NULL"
    if len(hkeys) != len(hvalues):
        return f"{len(hkeys)} header keys but {len(hvalues)} header values"
    if any(k is None for k in hkeys):
        return "a header key is NULL"
    return None

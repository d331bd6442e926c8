"""Checks on an outbox row before it becomes a Kafka message, shared by both record sources (the
mark-purge/reset store and the log source)."""

from __future__ import annotations


def malformed(key: str | None, hkeys: list[str] | None, hvalues: list[str | None] | None) -> str | None:
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

"""Which delivery failures are worth waiting out, and which mean the record itself is the problem.

*Retriable* failures (broker down, timeouts, leader elections, throttling) say nothing about the
record: the harvester backs off and retries without counting an attempt against it. *Permanent*
failures (too large, invalid or unknown topic, not authorised, malformed row) will recur on every
try: they count attempts, and after ``max_attempts`` the record is dead-lettered.
"""

from __future__ import annotations

from typing import Literal

from confluent_kafka import KafkaError

from harvester.record import RecordError

ErrorClass = Literal["retriable", "permanent"]

_PERMANENT_NAMES = (
    "MSG_SIZE_TOO_LARGE",
    "RECORD_LIST_TOO_LARGE",
    "INVALID_RECORD",
    "TOPIC_EXCEPTION",
    "_UNKNOWN_TOPIC",
    "UNKNOWN_TOPIC_OR_PART",
    "TOPIC_AUTHORIZATION_FAILED",
    "POLICY_VIOLATION",
    "UNSUPPORTED_FOR_MESSAGE_FORMAT",
    "_INVALID_ARG",
    "_BAD_MSG",
)
PERMANENT_CODES = frozenset(getattr(KafkaError, n) for n in _PERMANENT_NAMES if hasattr(KafkaError, n))


class MalformedRecordError(RecordError):
    """A row the harvester cannot turn into a Kafka message (for example header arrays of
    different lengths, or a NULL key)."""


def classify(error: Exception) -> ErrorClass:
    """Classify a delivery or validation error."""
    if isinstance(error, RecordError):
        return "permanent"
    code = getattr(error, "code", None)
    if isinstance(code, int) and code in PERMANENT_CODES:
        return "permanent"
    return "retriable"


def reason(error: Exception) -> str:
    """A short, stable label for metrics (the Kafka error name, or ``malformed``)."""
    if isinstance(error, RecordError):
        return "malformed"
    name = getattr(error, "name", None)
    return str(name).lower().lstrip("_") if name else type(error).__name__

"""Which delivery failures are worth waiting out, and which mean the record itself is the problem.

*Retriable* failures (broker down, timeouts, leader elections, throttling) say nothing about the
record: the harvester backs off and retries without counting an attempt against it. *Permanent*
failures (too large, invalid or unknown topic, not authorised, malformed row) will recur on every
try: they count attempts, and after ``max_attempts`` the record is dead-lettered. The publisher
decides which of its errors are permanent (:class:`PublishError`); the core knows no broker.

A permanent error may also be *shared*: the broker refused the whole batch the record went in (too
large, say, because of another record of the batch or of all of them together), so the record itself
may be innocent. Such a record counts an attempt only when it went out alone
(:attr:`harvester.core.settle.Settler.solo`).
"""

from __future__ import annotations

from typing import Literal

from harvester.core.records import RecordError

ErrorClass = Literal["retriable", "permanent"]


class PublishError(Exception):
    """A publisher's report that a record was not accepted.

    ``reason`` is a short, stable label for metrics and dead letters; ``permanent`` says that
    publishing the same record again cannot succeed; ``shared`` that the refusal may have been of the
    batch the record went in rather than of the record."""

    def __init__(self, message: str, *, reason: str, permanent: bool, shared: bool = False) -> None:
        super().__init__(message)
        self.reason = reason
        self.permanent = permanent
        self.shared = shared


class MalformedRecordError(RecordError):
    """A row the harvester cannot turn into a message (for example header arrays of different
    lengths, or a NULL key)."""


def classify(error: Exception) -> ErrorClass:
    """Classify a delivery or validation error; anything unknown is retriable."""
    if isinstance(error, RecordError) or (isinstance(error, PublishError) and error.permanent):
        return "permanent"
    return "retriable"


def shared(error: Exception) -> bool:
    """Whether a permanent ``error`` may concern the record's batch rather than the record."""
    return isinstance(error, PublishError) and error.permanent and error.shared


def reason(error: Exception) -> str:
    """A short, stable label for metrics (the publisher's reason, or ``malformed``)."""
    if isinstance(error, RecordError):
        return "malformed"
    if isinstance(error, PublishError):
        return error.reason
    return type(error).__name__

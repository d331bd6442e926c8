"""Tuning of the mark-purge/reset loop and of leader election (goharvest's ``limits:`` block).

Field names are snake_case; every field also accepts goharvest's camelCase spelling. Durations accept
Go-style strings (``100ms``, ``5s``). Defaults match goharvest's documented defaults.
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated

from pydantic import AliasChoices, AliasGenerator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.alias_generators import to_camel

from harvester.core.durations import parse_duration

Duration = Annotated[timedelta, BeforeValidator(parse_duration)]

# Every field also accepts its camelCase spelling (goharvest's); irregular ones are spelled out.
BOTH_SPELLINGS = ConfigDict(
    extra="forbid",
    frozen=True,
    populate_by_name=True,
    alias_generator=AliasGenerator(validation_alias=lambda name: AliasChoices(name, to_camel(name))),
)


class Limits(BaseModel):
    """Tuning of the MP/R loop and of leader election."""

    model_config = BOTH_SPELLINGS

    io_error_backoff: Duration = Field(default=timedelta(milliseconds=500))
    poll_duration: Duration = Field(default=timedelta(milliseconds=1))
    min_poll_interval: Duration = Field(
        default=timedelta(milliseconds=100),
    )
    max_poll_interval: Duration = Field(default=timedelta(minutes=5))
    heartbeat_timeout: Duration = Field(default=timedelta(seconds=5))
    drain_interval: Duration = Field(default=timedelta(minutes=1))
    queue_timeout: Duration = Field(default=timedelta(seconds=30))
    mark_backoff: Duration = Field(default=timedelta(milliseconds=10))
    max_mark_backoff: Duration = Field(
        default=timedelta(milliseconds=500),
        description="Ceiling of the adaptive back-off while the outbox stays empty.",
    )
    max_in_flight_records: int = Field(default=1000, ge=1)
    max_queued_records: int = Field(
        default=10000,
        ge=1,
        description="Bound on marked records waiting behind a busy key (memory bound of the key FIFOs).",
    )
    min_metrics_interval: Duration = Field(
        default=timedelta(seconds=5),
    )
    send_concurrency: int = Field(
        default=8,
        ge=1,
        description="Accepted for goharvest compatibility; one librdkafka producer already sends concurrently.",
    )
    send_buffer: int = Field(default=10, ge=0)
    max_attempts: int = Field(
        default=3,
        ge=1,
        description="Permanent delivery failures of a record before it is dead-lettered.",
    )
    retry_backoff: Duration = Field(
        default=timedelta(milliseconds=100),
        description="First back-off after a retriable delivery failure; doubles (with jitter) per round.",
    )
    max_retry_backoff: Duration = Field(
        default=timedelta(seconds=10),
        description="Ceiling of the retriable-failure back-off.",
    )
    mark_query_records: int = Field(default=100, ge=1)

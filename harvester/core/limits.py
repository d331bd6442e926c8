"""Tuning of the mark-purge/reset loop and of leader election (goharvest's ``limits:`` block).

Field names are snake_case; every field also accepts goharvest's camelCase spelling. Durations accept
Go-style strings (``100ms``, ``5s``). Defaults are goharvest's where it has the setting, except those
docs/reaper.md lists under "Differences from goharvest".
"""

from __future__ import annotations

from datetime import timedelta
from typing import Annotated, Literal

from pydantic import AliasChoices, AliasGenerator, BaseModel, BeforeValidator, ConfigDict, Field
from pydantic.alias_generators import to_camel

from harvester.core.durations import parse_duration

Duration = Annotated[timedelta, BeforeValidator(parse_duration)]


def _positive_or_auto(value: object) -> object:
    """``auto``, or a whole number of at least 1 (also as a string, as environment overrides give it)."""
    if value == "auto":
        return value
    number = value if isinstance(value, int) and not isinstance(value, bool) else None
    if isinstance(value, str) and value.strip().isdigit():
        number = int(value)
    if number is None or number < 1:
        raise ValueError(f"must be a whole number of at least 1, or 'auto'; not {value!r}")
    return number


PositiveOrAuto = Annotated[int | Literal["auto"], BeforeValidator(_positive_or_auto)]

# What "auto" means for the batch limits. Marks start at goharvest's 100 records (a quiet outbox
# keeps goharvest's latency) and grow while the backlog lasts; the window and the largest mark are
# where `./dev.sh bench harvest` drained fastest on 2 cores: larger batches queue more records
# behind busy keys and cost the harvester more CPU per record.
AUTO_MARK_RECORDS = (100, 500)
AUTO_IN_FLIGHT = 5000

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
    max_in_flight_records: PositiveOrAuto = Field(
        default="auto",
        description="Records published and not yet acknowledged, at most; 'auto': 5000.",
    )
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
    stall_timeout: Duration = Field(
        default=timedelta(minutes=5),
        description="A store statement failing this long without a success stalls the harvester: it is no "
        "longer alive (the reaper's /healthz answers 503); its records stay in the outbox.",
    )
    statement_timeout: Duration = Field(
        default=timedelta(seconds=60),
        description="A harvester statement without an answer for this long fails as a lost connection (the "
        "server's statement_timeout, libpq's tcp_user_timeout and keepalives, and a client-side deadline for a "
        "path that stalls); 0 turns these off.",
    )
    mark_query_records: PositiveOrAuto = Field(
        default="auto",
        description="Records marked per query, at most; 'auto': from 100, doubling while marks come back full, to 500.",
    )

    vacuum_every_records: int = Field(
        default=100_000,
        ge=0,
        description="Vacuum the outbox after this many purged records while a backlog drains (0: leave it to "
        "autovacuum); needs the table's owner. Mark-purge/reset only: the log source reads no rows.",
    )

    @property
    def in_flight_bound(self) -> int:
        """The in-flight window in records."""
        return AUTO_IN_FLIGHT if self.max_in_flight_records == "auto" else self.max_in_flight_records

    @property
    def mark_sizes(self) -> tuple[int, int]:
        """The first and the largest number of records one mark asks for."""
        if self.mark_query_records == "auto":
            return AUTO_MARK_RECORDS
        return self.mark_query_records, self.mark_query_records

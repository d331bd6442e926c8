"""The options of the ``outbox`` streaming source, checked on the driver before anything runs."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from harvester.core.identity import DEFAULT_PREFIX
from harvester.postgres.identifiers import IdentifierError, TableName

DEFAULT_MAX_RECORDS = 10_000


class DrainConfigError(ValueError):
    """The ``outbox`` streaming source's options are missing or inconsistent."""


def _positive(options: Mapping[str, str], name: str, default: int) -> int:
    """Option ``name`` (looked up in lower case, as Spark may pass it) as a positive integer."""
    text = options.get(name.lower())
    if text is None:
        return default
    try:
        value = int(text)
    except ValueError:
        value = 0
    if value < 1:
        raise DrainConfigError(f"option {name} must be a positive integer, not {text!r}")
    return value


@dataclass(frozen=True, slots=True)
class DrainOptions:
    """What a drain of one outbox needs; plain values, pickled to every executor."""

    dsn: str
    table: TableName
    shards: int
    max_records: int  # per micro-batch, over all shards (``maxRecordsPerTrigger``)
    header_prefix: str
    producer_name: str | None

    @classmethod
    def parse(cls, options: Mapping[str, str]) -> DrainOptions:
        """Options as Spark passes them (case-insensitive keys); raises :class:`DrainConfigError`."""
        lowered = {k.lower(): v for k, v in options.items()}
        dsn = lowered.get("dsn")
        if not dsn:
            raise DrainConfigError("option dsn is required: a libpq connection string")
        try:
            table = TableName.parse(lowered.get("table", "outbox"))
        except IdentifierError as exc:
            raise DrainConfigError(str(exc)) from exc
        return cls(
            dsn=dsn,
            table=table,
            shards=_positive(lowered, "shards", 1),
            max_records=_positive(lowered, "maxRecordsPerTrigger", DEFAULT_MAX_RECORDS),
            header_prefix=lowered.get("headerprefix", DEFAULT_PREFIX),
            producer_name=lowered.get("producername") or None,
        )

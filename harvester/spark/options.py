"""Reading the options of the drain (``readStream.format("outbox")``) and of its sink
(``writeStream.format("outbox-publish")``), which share these, as Spark passes them: keys in lower
case, values as text."""

from __future__ import annotations

from collections.abc import Mapping

from harvester.postgres.schema.identifiers import IdentifierError, TableName

DEFAULT_MAX_ATTEMPTS = 3
"""Permanent refusals of a record before it is dead-lettered: a reaper's ``maxAttempts``."""


class DrainConfigError(ValueError):
    """The drain's or its sink's options are missing or inconsistent."""


def positive(options: Mapping[str, str], name: str, default: int) -> int:
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


def flag(options: Mapping[str, str], name: str) -> bool:
    """Option ``name`` (looked up in lower case) as a boolean, false unless given."""
    text = options.get(name.lower(), "false")
    if text.lower() not in ("true", "false"):
        raise DrainConfigError(f"option {name} must be true or false, not {text!r}")
    return text.lower() == "true"


def outbox_of(options: Mapping[str, str], dsn_is: str) -> tuple[str, TableName]:
    """Options ``dsn`` (required; ``dsn_is`` says what for) and ``table`` (default ``outbox``), looked
    up in lower case; the drain and the publishing sink read them alike."""
    dsn = options.get("dsn")
    if not dsn:
        raise DrainConfigError(f"option dsn is required: {dsn_is}")
    try:
        return dsn, TableName.parse(options.get("table", "outbox"))
    except IdentifierError as exc:
        raise DrainConfigError(str(exc)) from exc

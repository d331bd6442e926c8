"""What a ``reaper.yaml`` holds: the pydantic models of its sections, validated.

A file has up to five sections::

    harvest:   # HarvesterConfig: goharvest's block, unchanged (camelCase) or in snake_case;
               # or a list of such blocks, one per outbox this reaper harvests
    logging:   # level (goharvest's names accepted), format
    http:      # the /metrics, /healthz and /readyz endpoint
    shutdown:  # how long a graceful stop may wait for in-flight acknowledgements
    startup:   # how long run waits for Kafka at start
    workers:   # a number: reaper processes this one supervises (default 1: no supervisor)

Reading them (the YAML file, ``REAPER_`` variables, secret references) is
:mod:`harvester.daemon.loading`'s and :mod:`harvester.daemon.environment`'s.
"""

from __future__ import annotations

from collections.abc import Sequence
from datetime import timedelta
from typing import Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    field_validator,
    model_validator,
)

from harvester.config import HarvesterConfig
from harvester.core.limits import Duration
from harvester.daemon.logs import SECRET_NAME

# goharvest's reaper used libstdgo's scribe level names (Trace, Debug, Info, Warn, Error, Off, All);
# matching is case-insensitive here, and Python's "warning" and "critical" are accepted too.
LOG_LEVELS = ("all", "trace", "debug", "info", "warn", "warning", "error", "critical", "off")


class SettingsError(Exception):
    """A configuration mistake; ``str()`` is a one-line message naming the field."""


class LoggingSettings(BaseModel):
    """The ``logging:`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    level: str = Field(default="info", description="trace, debug, info, warn, error or off (any case).")
    format: Literal["auto", "json", "console"] = Field(
        default="auto", description="auto: readable console output on a terminal, JSON lines otherwise."
    )

    @field_validator("level")
    @classmethod
    def _level(cls, value: str) -> str:
        if value.lower() not in LOG_LEVELS:
            raise ValueError(f"unknown log level {value!r}; use one of trace, debug, info, warn, error, off")
        return value.lower()


DEFAULT_HTTP_PORT = 9090
"""``http.port`` when the configuration does not set it."""


class HttpSettings(BaseModel):
    """The ``http:`` section: Prometheus metrics and the health endpoints."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    enabled: bool = True
    host: str = "0.0.0.0"  # a sidecar's probes and scrapers connect from outside the pod
    port: int = Field(
        default=DEFAULT_HTTP_PORT,
        ge=0,
        le=65535,
        description="0 picks a free port (logged at start). Left unset, 9090 when free, else a free port.",
    )


class ShutdownSettings(BaseModel):
    """The ``shutdown:`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    timeout: Duration = Field(
        default=timedelta(seconds=20),
        description="Bound on the wait for in-flight acknowledgements after SIGTERM; below Kubernetes' default "
        "30 s grace period so the reaper leaves its group before it is killed.",
    )


class StartupSettings(BaseModel):
    """The ``startup:`` section."""

    model_config = ConfigDict(extra="forbid", frozen=True)

    kafka_timeout: Duration = Field(
        default=timedelta(seconds=30),
        gt=timedelta(0),
        validation_alias=AliasChoices("kafka_timeout", "kafkaTimeout"),
        description="How long run waits for each Kafka cluster at start (librdkafka reconnects meanwhile): "
        "long enough for a sidecar started together with its broker, then exit 2 naming the cause.",
    )


class ReaperSettings(BaseModel):
    """Everything in ``reaper.yaml``.

    ``harvest`` is the first (often the only) harvest section; :attr:`harvests` lists them all. A
    file whose ``harvest:`` is a list is validated one section at a time (:func:`load`), as a
    settings object per section; :meth:`section` gives each back with the shared logging, http
    shutdown and startup sections, so every per-outbox command works on one section at a time.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    harvest: HarvesterConfig = Field(default_factory=HarvesterConfig)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    shutdown: ShutdownSettings = Field(default_factory=ShutdownSettings)
    startup: StartupSettings = Field(default_factory=StartupSettings)
    workers: int = Field(
        default=1,
        ge=1,
        le=64,
        description="Reaper processes run under one supervisor, each a member of the leader groups, so the "
        "shards are spread over them and each uses a core of its own; 1 runs the harvesters in this process.",
    )
    _more: tuple[ReaperSettings, ...] = PrivateAttr(default=())  # sections 1.. of a list, each whole

    @property
    def harvests(self) -> tuple[HarvesterConfig, ...]:
        """Every harvest section, in file order."""
        return (self.harvest, *(s.harvest for s in self._more))

    @property
    def sections(self) -> tuple[ReaperSettings, ...]:
        """One settings object per harvest section (each with a single ``harvest``)."""
        if not self._more:
            return (self,)
        first = self.model_copy()
        first._more = ()
        return (first, *self._more)

    def with_sections(self, more: Sequence[ReaperSettings]) -> ReaperSettings:
        """This (the first section's settings) followed by ``more``, one per further harvest section."""
        self._more = tuple(more)
        return self

    @model_validator(mode="after")
    def _checks(self) -> ReaperSettings:
        from psycopg.conninfo import conninfo_to_dict

        try:
            conninfo_to_dict(self.harvest.data_source)
        except Exception:  # libpq's message may quote the DSN, password included: say what is wrong instead
            raise ValueError(
                "harvest.dataSource: not a valid libpq connection string (key=value pairs or a postgresql:// URL)"
            ) from None
        # librdkafka takes scalar property values only; a nested map would fail later, far from its cause.
        for section, props in (
            ("baseKafkaConfig", self.harvest.base_kafka_config),
            ("producerKafkaConfig", self.harvest.producer_kafka_config),
        ):
            for key, value in props.items():
                if not isinstance(value, str | int | float | bool):
                    raise ValueError(f"harvest.{section}.{key}: must be a string, number or boolean")
        return self

    @property
    def http_port_explicit(self) -> bool:
        """Whether ``http.port`` was set, in the file or by ``REAPER_HTTP__PORT``, rather than defaulted.

        A defaulted port may fall back to a free one when busy (several reapers on one host, as in
        goharvest's failover set-up, which had no HTTP server to configure); a chosen one may not.
        Environment overrides are written into the data before validation, so they count as set.
        """
        return "http" in self.model_fields_set and "port" in self.http.model_fields_set


def defaulted_connections(settings: ReaperSettings) -> list[str]:
    """The connection settings the configuration left to their defaults, each with the default, so
    ``check`` and ``run`` can say where they connect (an empty file still runs, as goharvest's does)."""
    harvest = settings.harvest
    given = harvest.model_fields_set if "harvest" in settings.model_fields_set else set()
    found = []
    if "data_source" not in given:
        found.append(f"harvest.dataSource ({harvest.data_source})")
    if "base_kafka_config" not in given:
        found.append(f"harvest.baseKafkaConfig (bootstrap.servers: {harvest.base_kafka_config['bootstrap.servers']})")
    return found


def secret_values(settings: ReaperSettings) -> list[str]:
    """The secret strings of ``settings``: every section's DSN password and secret Kafka properties.

    These are what logging and error output redact.
    """
    found: list[str] = []
    for harvest in settings.harvests:
        found.extend(dsn_secrets(harvest.data_source))
        for props in (harvest.base_kafka_config, harvest.producer_kafka_config):
            found.extend(str(v) for k, v in props.items() if SECRET_NAME.search(k) and str(v))
    return found


def dsn_secrets(dsn: str) -> list[str]:
    """The password and the client key's passphrase (``sslpassword``) in a libpq connection string
    (key=value or URL form), if any."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(dsn)
    except Exception:  # an unparsable DSN is reported elsewhere; pattern redaction still applies
        return []
    return [str(params[key]) for key in ("password", "sslpassword") if params.get(key)]


def spellings(model: type[BaseModel], name: str) -> list[str]:
    """Every key that sets field ``name`` of ``model``: its snake_case name first, then its aliases
    (goharvest's camelCase)."""
    alias = model.model_fields[name].validation_alias
    extra = [str(c) for c in alias.choices] if isinstance(alias, AliasChoices) else []
    return [name, *(c for c in extra if c != name)]

"""The whole ``reaper.yaml``: loading, environment overrides, secret references and validation.

A file has up to four sections::

    harvest:   # HarvesterConfig: goharvest's block, unchanged (camelCase) or in snake_case;
               # or a list of such blocks, one per outbox this reaper harvests
    logging:   # level (goharvest's names accepted), format
    http:      # the /metrics, /healthz and /readyz endpoint
    shutdown:  # how long a graceful stop may wait for in-flight acknowledgements

Precedence, lowest first: built-in defaults (goharvest's), the YAML file, ``REAPER_<SECTION>__<FIELD>``
environment variables (with a list of harvest sections, ``REAPER_HARVEST__<FIELD>`` sets every section and
``REAPER_HARVEST__<i>__<FIELD>`` section ``i``). Any string may then refer to a secret as ``${env:NAME}``
or ``${file:/path}``.
Every mistake raises :class:`SettingsError` with one line that names the offending field.
"""

from __future__ import annotations

import os
import re
from collections.abc import Iterator, Mapping
from datetime import timedelta
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import (
    AliasChoices,
    BaseModel,
    ConfigDict,
    Field,
    PrivateAttr,
    ValidationError,
    field_validator,
    model_validator,
)

from harvester.config import HarvesterConfig
from harvester.core.limits import Duration
from harvester.daemon.logs import SECRET_NAME

ENV_PREFIX = "REAPER_"
CONFIG_ENV = "REAPER_CONFIG"
"""Environment variable naming the configuration file when ``-f`` is not given."""

# goharvest's reaper used libstdgo's scribe level names (Trace, Debug, Info, Warn, Error, Off, All);
# matching is case-insensitive here, and Python's "warning" and "critical" are accepted too.
LOG_LEVELS = ("all", "trace", "debug", "info", "warn", "warning", "error", "critical", "off")

_REFERENCE = re.compile(r"\$(\$?)\{(env|file):([^}]*)\}")


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


class ReaperSettings(BaseModel):
    """Everything in ``reaper.yaml``.

    ``harvest`` is the first (often the only) harvest section; :attr:`harvests` lists them all. A
    file whose ``harvest:`` is a list is validated one section at a time (:func:`load`), as a
    settings object per section; :meth:`section` gives each back with the shared logging, http
    and shutdown sections, so every per-outbox command works on one section at a time.
    """

    model_config = ConfigDict(extra="forbid", frozen=True)

    harvest: HarvesterConfig = Field(default_factory=HarvesterConfig)
    logging: LoggingSettings = Field(default_factory=LoggingSettings)
    http: HttpSettings = Field(default_factory=HttpSettings)
    shutdown: ShutdownSettings = Field(default_factory=ShutdownSettings)
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
    """The password in a libpq connection string (key=value or URL form), if any."""
    from psycopg.conninfo import conninfo_to_dict

    try:
        params = conninfo_to_dict(dsn)
    except Exception:  # an unparsable DSN is reported elsewhere; pattern redaction still applies
        return []
    password = params.get("password")
    return [str(password)] if password else []


def load(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> ReaperSettings:
    """Read ``path`` (or nothing: defaults only), apply ``REAPER_*`` overrides and secret references.

    ``environ`` defaults to ``os.environ``. Raises :class:`SettingsError`.
    """
    env = os.environ if environ is None else environ
    data: dict[str, Any] = _read_yaml(Path(path)) if path is not None else {}
    source = str(path) if path is not None else "configuration"
    origins: dict[tuple[str, ...], str] = {}
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name != CONFIG_ENV:
            if "__" not in name:
                raise SettingsError(
                    f"{name}: unknown setting; a section and its fields are separated by two underscores, "
                    f"as in REAPER_HARVEST__OUTBOX_TABLE"
                )
            origins[_apply_override(data, name, env[name])] = name
    _refuse_double_spellings(data, ReaperSettings, ())
    data = _resolve_references(data, (), env, origins)
    sections = data.get("harvest")
    if not isinstance(sections, list):
        return _validate(data, source, origins, None)
    if not sections:
        raise SettingsError(f"{source}: harvest: an empty list; give one section per outbox")
    each = [_validate({**data, "harvest": section}, source, origins, i) for i, section in enumerate(sections)]
    _refuse_shared(each, source)
    first = each[0]
    first._more = tuple(each[1:])
    return first


def _validate(
    data: dict[str, Any], source: str, origins: Mapping[tuple[str, ...], str], index: int | None
) -> ReaperSettings:
    """One settings object; ``index`` is the harvest section's place in a list, named in errors."""
    try:
        return ReaperSettings.model_validate(data)
    except ValidationError as exc:
        raise SettingsError(_describe(exc, source, origins, index)) from None


def _refuse_shared(sections: list[ReaperSettings], source: str) -> None:
    """Two harvest sections may not harvest one table (of one database) or share a leader group or
    leader topic: their leaders would fight over the same records, or take each other's partitions."""
    seen: dict[tuple[str, object], int] = {}
    for i, settings in enumerate(sections):
        harvest = settings.harvest
        claims = {
            # An unqualified name is taken as public's, the usual search_path, to err on refusing.
            "outboxTable": (_database(harvest.data_source), harvest.table.schema or "public", harvest.table.name),
            "leaderGroupID": harvest.group_id,
            "leaderTopic": harvest.topic,
        }
        for name, value in claims.items():
            earlier = seen.setdefault((name, value), i)
            if earlier != i:
                shown = harvest.table.qualified if isinstance(value, tuple) else value
                raise SettingsError(
                    f"{source}: harvest[{i}].{name}: {shown} is already harvest[{earlier}]'s; "
                    "each harvest section needs its own outbox table, leader group and leader topic"
                )


def _database(dsn: str) -> tuple[str, str, str]:
    """Where a connection string leads (host, port, database), to tell one table from its namesake
    in another database."""
    from psycopg.conninfo import conninfo_to_dict

    params = conninfo_to_dict(dsn)  # validated by the model already
    return (str(params.get("host", "")), str(params.get("port", "")), str(params.get("dbname", "")))


class _UniqueKeyLoader(yaml.SafeLoader):
    """YAML's safe loader, refusing a key given twice in one mapping (PyYAML keeps the last one)."""

    def construct_mapping(self, node: yaml.MappingNode, deep: bool = False) -> dict[Any, Any]:
        seen: set[Any] = set()
        for key_node, _ in node.value:
            key = self.construct_object(key_node, deep=deep)
            if key in seen:
                mark = key_node.start_mark
                raise yaml.constructor.ConstructorError(
                    None, None, f"key {key!r} given twice in one mapping", mark
                )
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _refuse_double_spellings(data: Any, model: type[BaseModel], path: tuple[str, ...]) -> None:
    """A setting given under two spellings (``outboxTable`` and ``outbox_table``) is an error that
    says so, rather than the second spelling's "unknown key"."""
    if not isinstance(data, dict):
        return
    for name, field in model.model_fields.items():
        given = [c for c in _choices(model, name) if c in data]
        if len(given) > 1:
            where = ".".join(path)
            raise SettingsError(
                f"{where + ': ' if where else ''}{' and '.join(given)} are the same setting; give it once"
            )
        annotation = field.annotation
        if given and isinstance(annotation, type) and issubclass(annotation, BaseModel):
            value = data[given[0]]
            for i, item in enumerate(value) if isinstance(value, list) else ((None, value),):
                _refuse_double_spellings(item, annotation, (*path, given[0] if i is None else f"{given[0]}[{i}]"))


def _read_yaml(path: Path) -> dict[str, Any]:
    try:
        text = path.read_text("utf-8")
    except FileNotFoundError:
        raise SettingsError(f"{path}: no such configuration file") from None
    except OSError as exc:
        raise SettingsError(f"{path}: cannot read: {exc.strerror}") from None
    except UnicodeDecodeError:
        raise SettingsError(f"{path}: not UTF-8 text") from None
    try:
        data = yaml.load(text, Loader=_UniqueKeyLoader)  # a SafeLoader: no arbitrary objects
    except yaml.YAMLError as exc:
        mark = getattr(exc, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark is not None else ""
        problem = getattr(exc, "problem", None) or "syntax error"
        raise SettingsError(f"{path}: invalid YAML{where}: {problem}") from None
    if data is None:
        return {}
    if not isinstance(data, dict):
        raise SettingsError(f"{path}: the top level must be a mapping of sections (harvest:, logging:, ...)")
    return data


def _choices(model: type[BaseModel], name: str) -> list[str]:
    alias = model.model_fields[name].validation_alias
    extra = [str(c) for c in alias.choices] if isinstance(alias, AliasChoices) else []
    return [name, *(c for c in extra if c != name)]


def _field_for(model: type[BaseModel], segment: str) -> str | None:
    # Env names are upper case: match snake_case names, and camelCase aliases ignoring case.
    wanted = segment.lower()
    for name in model.model_fields:
        if wanted in (c.lower() for c in _choices(model, name)):
            return name
    return None


def _apply_override(data: dict[str, Any], var: str, value: str) -> tuple[str, ...]:
    """Set ``REAPER_A__B__C=value`` into ``data``; return the key path it was written at."""
    segments = var[len(ENV_PREFIX) :].split("__")
    model: type[BaseModel] = ReaperSettings
    node = data
    path: list[str] = []
    for i, segment in enumerate(segments):
        name = _field_for(model, segment) if segment else None
        if name is None:
            raise SettingsError(f"{var}: unknown setting {'.'.join([*path, segment.lower()]) or var}")
        # Reuse whichever spelling the file used, so a camelCase file and a snake_case override meet.
        spellings = [c for c in _choices(model, name) if c in node]
        key = spellings[0] if spellings else name
        last = i == len(segments) - 1
        annotation = model.model_fields[name].annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel) and not last:
            child = node.get(key)
            if isinstance(child, list):  # several harvest sections
                return _apply_to_sections(child, var, segments[i + 1 :], value, key)
            if not isinstance(child, dict):
                child = node[key] = {}
            node, model = child, annotation
            path.append(key)
            continue
        if last:
            for spelling in spellings:
                del node[spelling]
            node[name] = value
            return (*path, name)
        if name in ("base_kafka_config", "producer_kafka_config") and i == len(segments) - 2:
            # Kafka property names are dotted and never contain '_': SASL_PASSWORD is sasl.password.
            props = node.get(key)
            if not isinstance(props, dict):
                props = node[key] = {}
            prop = segments[-1].lower().replace("_", ".")
            props[prop] = value
            return (*path, key, prop)
        raise SettingsError(f"{var}: {'.'.join([*path, name])} has no setting {segments[i + 1].lower()!r}")
    raise SettingsError(f"{var}: names no setting")


def _apply_to_sections(sections: list[Any], var: str, rest: list[str], value: str, key: str) -> tuple[str, ...]:
    """``REAPER_HARVEST__<i>__FIELD`` sets section ``i``; ``REAPER_HARVEST__FIELD`` every section (a
    shared data source or password, say). Returns the path written: ``harvest[i]...`` for one
    section, ``harvest...`` for all (:func:`_where` matches it for any section)."""
    if rest and rest[0].isdigit():
        index = int(rest[0])
        if index >= len(sections) or len(rest) < 2:
            raise SettingsError(f"{var}: {key} has no section {index} (the file lists {len(sections)})")
        targets, rest = [index], rest[1:]
    else:
        targets = list(range(len(sections)))
    path: tuple[str, ...] = ()
    for index in targets:
        if not isinstance(sections[index], dict):
            raise SettingsError(f"{var}: {key}[{index}] is not a mapping of settings")
        sub: dict[str, Any] = {key: sections[index]}
        path = _apply_override(sub, f"{ENV_PREFIX}{key.upper()}__{'__'.join(rest)}", value)
    return (f"{key}[{targets[0]}]", *path[1:]) if len(targets) == 1 else ("harvest", *path[1:])


def _resolve_references(
    value: Any, path: tuple[str, ...], env: Mapping[str, str], origins: Mapping[tuple[str, ...], str]
) -> Any:
    if isinstance(value, dict):
        return {k: _resolve_references(v, (*path, str(k)), env, origins) for k, v in value.items()}
    if isinstance(value, list):
        return [_resolve_references(v, (*path, str(i)), env, origins) for i, v in enumerate(value)]
    if not isinstance(value, str) or "${" not in value:
        return value

    def substitute(m: re.Match[str]) -> str:
        if m.group(1):  # "$${...}" is the escape for a literal "${...}"
            return m.group(0)[1:]
        kind, ref = m.group(2), m.group(3).strip()
        where = _where(path, origins)
        if kind == "env":
            if ref not in env:
                raise SettingsError(f"{where}: environment variable {ref} (referenced as ${{env:{ref}}}) is not set")
            return env[ref]
        try:
            # Secret files usually end with a newline that is not part of the secret.
            return Path(ref).read_text("utf-8").removesuffix("\n").removesuffix("\r")
        except OSError as exc:
            raise SettingsError(f"{where}: cannot read secret file {ref}: {exc.strerror}") from None

    return _REFERENCE.sub(substitute, value)


def _where(path: tuple[str, ...], origins: Mapping[tuple[str, ...], str]) -> str:
    dotted = ".".join(path) or "(top level)"
    # An override of every harvest section is recorded under "harvest", one of section i under "harvest[i]".
    every = tuple(re.sub(r"^harvest\[\d+\]$", "harvest", p) for p in path)
    for length in range(len(path), 0, -1):
        var = origins.get(path[:length]) or origins.get(every[:length])
        if var is not None:
            return f"{var} ({dotted})"
    return dotted


def _describe(
    exc: ValidationError, source: str, origins: Mapping[tuple[str, ...], str], index: int | None = None
) -> str:
    errors = exc.errors(include_url=False, include_input=False)
    first = errors[0]
    loc = tuple(str(p) for p in first["loc"])
    msg = str(first["msg"]).removeprefix("Value error, ")
    if index is not None:  # a section of a list: name it by its place, in the location and the message
        if loc[:1] == ("harvest",):
            loc = (f"harvest[{index}]", *loc[1:])
        msg = msg.replace("harvest.", f"harvest[{index}].")
    if first["type"] == "extra_forbidden":
        msg = "unknown key (check its spelling and indentation)"
    elif first["type"] == "missing":
        msg = "required"
    where = _where(loc, origins) if loc else source
    more = f" (and {len(errors) - 1} more problem{'s' if len(errors) > 2 else ''})" if len(errors) > 1 else ""
    return f"{source}: {where}: {msg}{more}" if loc else f"{source}: {msg}{more}"


def iter_env_names(model: type[BaseModel] = ReaperSettings, prefix: str = ENV_PREFIX) -> Iterator[str]:
    """Every ``REAPER_*`` variable name that overrides a scalar setting (Kafka properties excluded)."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        var = f"{prefix}{name.upper()}"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from iter_env_names(annotation, f"{var}__")
        else:
            yield var

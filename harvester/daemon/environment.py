"""``REAPER_<SECTION>__<FIELD>`` environment variables: which setting each names, and writing its
value into the file's data before validation (so an override counts as set, as the file's keys do).

With a list of harvest sections, ``REAPER_HARVEST__<FIELD>`` sets every section and
``REAPER_HARVEST__<i>__<FIELD>`` section ``i``. Kafka properties follow their map:
``REAPER_HARVEST__BASE_KAFKA_CONFIG__SASL_PASSWORD`` is ``sasl.password``.
"""

from __future__ import annotations

from collections.abc import Iterator, Mapping
from typing import Any

from pydantic import BaseModel

from harvester.daemon.settings import ReaperSettings, SettingsError, spellings

ENV_PREFIX = "REAPER_"
CONFIG_ENV = "REAPER_CONFIG"
"""Environment variable naming the configuration file when ``-f`` is not given."""


def apply_environment(data: dict[str, Any], env: Mapping[str, str]) -> dict[tuple[str, ...], str]:
    """Write every ``REAPER_`` variable of ``env`` into ``data`` (the file's); return the variable
    that wrote each key path, for errors to name. An unknown variable is an error, as an unknown
    key is."""
    origins: dict[tuple[str, ...], str] = {}
    for name in sorted(env):
        if name.startswith(ENV_PREFIX) and name != CONFIG_ENV:
            if "__" not in name and not _top_level_scalar(name[len(ENV_PREFIX) :]):
                raise SettingsError(
                    f"{name}: unknown setting; a section and its fields are separated by two underscores, "
                    f"as in REAPER_HARVEST__OUTBOX_TABLE"
                )
            origins[_apply_override(data, name, env[name])] = name
    return origins


def _top_level_scalar(segment: str) -> bool:
    """Whether ``segment`` names a setting of the top level that is not a section (``workers``)."""
    name = _field_for(ReaperSettings, segment)
    if name is None:
        return False
    annotation = ReaperSettings.model_fields[name].annotation
    return not (isinstance(annotation, type) and issubclass(annotation, BaseModel))


def _field_for(model: type[BaseModel], segment: str) -> str | None:
    # Env names are upper case: match snake_case names, and camelCase aliases ignoring case.
    wanted = segment.lower()
    for name in model.model_fields:
        if wanted in (c.lower() for c in spellings(model, name)):
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
        used = [c for c in spellings(model, name) if c in node]
        key = used[0] if used else name
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
            for spelling in used:
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


def iter_env_names(model: type[BaseModel] = ReaperSettings, prefix: str = ENV_PREFIX) -> Iterator[str]:
    """Every ``REAPER_*`` variable name that overrides a scalar setting (Kafka properties excluded)."""
    for name, field in model.model_fields.items():
        annotation = field.annotation
        var = f"{prefix}{name.upper()}"
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            yield from iter_env_names(annotation, f"{var}__")
        else:
            yield var

"""Loading a ``reaper.yaml``: the file, ``REAPER_`` overrides, secret references, validation.

Precedence, lowest first: built-in defaults (goharvest's), the YAML file, ``REAPER_<SECTION>__<FIELD>``
environment variables (:mod:`harvester.daemon.environment`). Any string may then refer to a secret as
``${env:NAME}`` or ``${file:/path}``. A key given twice (in one mapping, or under two spellings) is
refused. Every mistake raises :class:`SettingsError` with one line that names the offending field
(``harvest[1].x`` in a list of harvest sections).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from harvester.daemon.environment import apply_environment
from harvester.daemon.settings import ReaperSettings, SettingsError, spellings

_REFERENCE = re.compile(r"\$(\$?)\{(env|file):([^}]*)\}")


def load(path: str | Path | None = None, environ: Mapping[str, str] | None = None) -> ReaperSettings:
    """Read ``path`` (or nothing: defaults only), apply ``REAPER_*`` overrides and secret references.

    ``environ`` defaults to ``os.environ``. Raises :class:`SettingsError`.
    """
    env = os.environ if environ is None else environ
    data: dict[str, Any] = _read_yaml(Path(path)) if path is not None else {}
    source = str(path) if path is not None else "configuration"
    origins = apply_environment(data, env)
    _refuse_double_spellings(data, ReaperSettings, ())
    data = _resolve_references(data, (), env, origins)
    sections = data.get("harvest")
    if not isinstance(sections, list):
        return _validate(data, source, origins, None)
    if not sections:
        raise SettingsError(f"{source}: harvest: an empty list; give one section per outbox")
    each = [_validate({**data, "harvest": section}, source, origins, i) for i, section in enumerate(sections)]
    _refuse_shared(each, source)
    return each[0].with_sections(each[1:])


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
                raise yaml.constructor.ConstructorError(None, None, f"key {key!r} given twice in one mapping", mark)
            seen.add(key)
        return super().construct_mapping(node, deep=deep)


def _refuse_double_spellings(data: Any, model: type[BaseModel], path: tuple[str, ...]) -> None:
    """A setting given under two spellings (``outboxTable`` and ``outbox_table``) is an error that
    says so, rather than the second spelling's "unknown key"."""
    if not isinstance(data, dict):
        return
    for name, field in model.model_fields.items():
        given = [c for c in spellings(model, name) if c in data]
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

"""The layers of docs/architecture.md, held by the source's own import statements: every one, at module
level, inside a function or under ``TYPE_CHECKING``, relative ones resolved. An import made by name at
run time (``import_module``) is not seen here; what the client really loads is checked in a fresh
interpreter by ``test_layout.py``."""

from __future__ import annotations

import ast
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import pytest

from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

ADAPTER_LIBRARIES = ("confluent_kafka", "psycopg", "pyspark", "opentelemetry")


@dataclass(frozen=True)
class Rule:
    """Modules under ``importers`` import nothing under ``forbidden`` unless it is under ``allowed``
    (or under ``exceptions[module]`` for that one module)."""

    name: str
    why: str
    importers: str
    forbidden: tuple[str, ...]
    allowed: tuple[str, ...] = ()
    exceptions: dict[str, tuple[str, ...]] = field(default_factory=dict)


RULES = [
    Rule(
        "core",
        "the engine core knows protocols only: no adapter, and of leader only its events",
        importers="harvester.core",
        forbidden=("harvester", "leader", *ADAPTER_LIBRARIES),
        allowed=("harvester.core", "leader.events"),
    ),
    Rule(
        "composition",
        "the harvester runs what harvester/compose.py builds: only the composition root knows the adapters",
        importers="harvester.harvester",
        forbidden=("harvester", "leader", *ADAPTER_LIBRARIES),
        allowed=("harvester.compose", "harvester.config", "harvester.core", "leader.events"),
    ),
    Rule("leader", "leader is a library of its own: it imports nothing of the harvester", "leader", ("harvester",)),
    Rule(
        "client",
        "what applications import stays light: no engine, no Kafka producer, no election",
        importers="harvester.client",
        forbidden=("harvester", "leader", "confluent_kafka", "pyspark"),
        # Itself, the records and their identity, the stashers' SQL side, the trace context (on first stash).
        allowed=(
            "harvester.client",
            "harvester.core.records",
            "harvester.core.identity",
            "harvester.postgres",
            "harvester.otel",
        ),
        # The de-duplicating reader wraps the application's Kafka consumer; it is imported on its own.
        exceptions={"harvester.client.dedup": ("confluent_kafka",)},
    ),
    *(
        Rule(f"{p}-library", "the library never reaches the demos, tests or benches", p, ("examples", "tests", "bench"))
        for p in ("harvester", "leader")
    ),
]


def under(name: str, prefixes: tuple[str, ...]) -> bool:
    return any(name == p or name.startswith(f"{p}.") for p in prefixes)


def imports(source: str, module: str, is_package: bool) -> Iterator[tuple[int, str]]:
    """(line, module name) of every import in ``source``, the source of ``module``. ``from m import n``
    yields ``m`` and ``m.n`` (``n`` may be a submodule)."""
    package = module if is_package else module.rpartition(".")[0]
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.Import):
            yield from ((node.lineno, a.name) for a in node.names)
        elif isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.rsplit(".", node.level - 1)[0] if node.level > 1 else package
                target = f"{base}.{node.module}" if node.module else base
            else:
                target = node.module or ""
            yield node.lineno, target
            yield from ((node.lineno, f"{target}.{a.name}") for a in node.names if a.name != "*")


def modules(importers: str) -> Iterator[tuple[str, Path, bool]]:
    """(module name, file, is a package) of every module under the dotted name ``importers``."""
    path = ROOT.joinpath(*importers.split("."))
    files = sorted(path.rglob("*.py")) if path.is_dir() else [path.with_suffix(".py")]
    for file in files:
        parts = file.relative_to(ROOT).with_suffix("").parts
        is_package = parts[-1] == "__init__"
        yield ".".join(parts[:-1] if is_package else parts), file, is_package


@pytest.mark.parametrize("rule", RULES, ids=lambda r: r.name)
def test_layer(rule: Rule) -> None:
    found = list(modules(rule.importers))
    assert found, f"no module under {rule.importers}"
    broken = [
        f"{file.relative_to(ROOT)}:{line} imports {name}"
        for module, file, is_package in found
        for line, name in imports(file.read_text("utf-8"), module, is_package)
        if under(name, rule.forbidden)
        and not under(name, rule.allowed)
        and not under(name, rule.exceptions.get(module, ()))
    ]
    assert broken == [], f"{rule.why}:\n" + "\n".join(broken)


def test_every_import_is_seen() -> None:
    source = """
from typing import TYPE_CHECKING
from . import records
from ..postgres.table.store import PostgresStore
if TYPE_CHECKING:
    import confluent_kafka
def later() -> None:
    from harvester.kafka import publisher
"""
    seen = {name for _line, name in imports(source, "harvester.core.engine", is_package=False)}
    assert {
        "harvester.core.records",
        "harvester.postgres.table.store.PostgresStore",
        "confluent_kafka",
        "harvester.kafka.publisher",
    } <= seen
    assert "harvester.core.records" in {n for _l, n in imports("from . import records", "harvester.core", True)}

"""docs/reaper.md documents every setting (both spellings), its environment variable and every metric."""

from __future__ import annotations

import pytest
from prometheus_client import CollectorRegistry
from pydantic import AliasChoices, BaseModel

from harvester.core.metrics import HarvesterMetrics
from harvester.daemon.settings import ReaperSettings, iter_env_names
from tests.support import ROOT

pytestmark = pytest.mark.unit

DOC = (ROOT / "docs" / "reaper.md").read_text()


def spellings(model: type[BaseModel]) -> list[str]:
    out: list[str] = []
    for name, field in model.model_fields.items():
        out.append(name)
        if isinstance(field.validation_alias, AliasChoices):
            out.extend(str(c) for c in field.validation_alias.choices)
        annotation = field.annotation
        if isinstance(annotation, type) and issubclass(annotation, BaseModel):
            out.extend(spellings(annotation))
    return out


def test_every_key_spelling_is_documented() -> None:
    missing = sorted({s for s in spellings(ReaperSettings) if f"`{s}`" not in DOC and f"`{s}:`" not in DOC})
    assert not missing


def test_every_environment_variable_is_documented() -> None:
    missing = sorted(name for name in iter_env_names() if name not in DOC)
    assert not missing


def test_every_metric_is_documented() -> None:
    registry = CollectorRegistry()
    HarvesterMetrics(registry)
    names = [m.name + ("_total" if m.type == "counter" else "") for m in registry.collect()]
    assert names
    missing = sorted(n for n in [*names, "reaper_info"] if f"`{n}`" not in DOC)
    assert not missing

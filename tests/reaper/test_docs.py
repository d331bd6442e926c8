"""docs/reaper.md documents every setting (both spellings), its environment variable and every metric;
the README's first screen and snippets hold; every relative link in the Markdown files resolves."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest
from prometheus_client import CollectorRegistry
from pydantic import AliasChoices, BaseModel

from harvester.core.metrics import HarvesterMetrics
from harvester.daemon.environment import iter_env_names
from harvester.daemon.settings import ReaperSettings
from tests.support.paths import ROOT

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


MARKDOWN = sorted([ROOT / "README.md", ROOT / "CHANGELOG.md", ROOT / "bench" / "README.md", *ROOT.glob("docs/*.md")])


def anchors(path: Path) -> set[str]:
    """GitHub's heading anchors: lower case, punctuation dropped, spaces as hyphens."""
    headings = re.findall(r"^#+ (.+)$", re.sub(r"```.*?```", "", path.read_text(), flags=re.DOTALL), re.MULTILINE)
    return {re.sub(r"[^\w\- ]", "", h.strip().lower()).replace(" ", "-") for h in headings}


@pytest.mark.parametrize("path", MARKDOWN, ids=lambda p: str(p.relative_to(ROOT)))
def test_every_relative_link_resolves(path: Path) -> None:
    links = re.findall(r"\]\(([^)\s]+)\)", path.read_text())
    broken = []
    for link in links:
        if re.match(r"[a-z]+:", link):
            continue  # an absolute URL
        target, _, anchor = link.partition("#")
        resolved = (path.parent / target).resolve() if target else path
        if not resolved.exists() or (anchor and anchor not in anchors(resolved)):
            broken.append(link)
    assert not broken


def test_readme_first_screen() -> None:
    """One sentence of what it is, then the two newcomer commands, and a pip install line for users."""
    readme = (ROOT / "README.md").read_text()
    blocks = re.findall(r"```(\w*)\n(.*?)```", readme, re.DOTALL)
    commands = [line.split("#")[0].strip() for line in blocks[0][1].splitlines()]
    assert commands == ["./dev.sh demo", "./dev.sh test"]
    assert blocks[1][1].startswith("pip install ")
    first_screen = readme[: readme.index("\n## ")]
    assert "./dev.sh" not in first_screen.replace(blocks[0][1], "")  # no third newcomer command
    for heading in ("## Why this and not goharvest", "## Terms", "## Guarantees", "## Limits", "## Supported versions"):
        assert heading in readme
    assert "(CHANGELOG.md)" in readme
    decision = readme[readme.index("## Why this and not goharvest") : readme.index("<!-- peers-table -->")]
    for row in ("server settings", "runtime", "throughput", "exactly-once", "Spark"):
        assert f"\n| {row}" in decision, row
    terms = readme[readme.index("## Terms") : readme.index("## Guarantees")]
    for word in ("Stasher", "Leader", "NELI", "Mark-purge/reset", "Fence, epoch", "Identity headers", "Shard", "Slot"):
        assert f"**{word}**" in terms, word
    assert "<!-- /peers-table -->" in readme  # bench/render_table.py --readme rewrites the block
    assert "`reaper status`" in readme
    limits = readme[readme.index("## Limits") : readme.index("## Supported versions")]
    assert "**The log source**" in limits and "planned" not in limits


def test_readme_python_snippets_define_every_name(tmp_path: Path) -> None:
    readme = (ROOT / "README.md").read_text()
    snippets = re.findall(r"```python\n(.*?)```", readme, re.DOTALL)
    assert snippets
    for number, snippet in enumerate(snippets):
        (tmp_path / f"snippet_{number}.py").write_text(snippet)
    ruff = Path(sys.executable).parent / "ruff"
    done = subprocess.run(
        [str(ruff), "check", "--isolated", "--select", "F", str(tmp_path)], capture_output=True, text=True, check=False
    )
    assert done.returncode == 0, done.stdout

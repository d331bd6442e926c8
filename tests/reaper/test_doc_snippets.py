"""Every fenced snippet in the README and docs/ is executed or parsed: ``sh`` with ``bash -n``,
``python`` compiled, ``yaml`` parsed and, when it is a ``reaper.yaml`` (a top-level ``harvest:``),
loaded by the reaper's own loader (its ``${file:…}`` secrets pointed at a temporary file, its
``${env:…}`` ones given a value), ``json`` parsed; ``sql`` is run by test_doc_sql.py. Blocks without a language
are program output or formats, ``mermaid`` is left to the tests of what it describes."""

from __future__ import annotations

import json
import re
import subprocess
import textwrap
from pathlib import Path

import pytest
import yaml

from harvester.daemon.loading import load
from harvester.daemon.settings import SettingsError
from tests.support.paths import ROOT

pytestmark = pytest.mark.unit

DOCS = sorted([ROOT / "README.md", ROOT / "bench" / "README.md", *ROOT.glob("docs/*.md")])
CHECKED = ("sh", "python", "yaml", "json")


def snippets(language: str) -> list[tuple[str, str]]:
    """(where, text) of every fenced block of that language: ``file:line``."""
    out = []
    for path in DOCS:
        text = path.read_text()
        for m in re.finditer(rf"^```{language}\n(.*?)^```", text, re.DOTALL | re.MULTILINE):
            out.append((f"{path.relative_to(ROOT)}:{text.count(chr(10), 0, m.start()) + 1}", m.group(1)))
    return out


def test_every_block_has_a_known_language_or_none() -> None:
    languages = {m for path in DOCS for m in re.findall(r"^```(\w+)$", path.read_text(), re.MULTILINE)}
    assert languages <= {*CHECKED, "sql", "mermaid"}
    for language in CHECKED:
        assert snippets(language), language


def test_shell_snippets_parse() -> None:
    broken = []
    for where, text in snippets("sh"):
        done = subprocess.run(["bash", "-n"], input=text, capture_output=True, text=True, check=False)
        if done.returncode:
            broken.append(f"{where}: {done.stderr.strip()}")
    assert not broken


def test_python_snippets_compile() -> None:
    broken = []
    for where, text in snippets("python"):
        try:
            # Snippets of asyncio services show the body of a coroutine: `async with` at top level.
            compile(text, where, "exec", flags=0x2000, dont_inherit=True)  # ast.PyCF_ALLOW_TOP_LEVEL_AWAIT
        except SyntaxError as exc:
            broken.append(f"{where}: {exc}")
    assert not broken


def test_json_snippets_parse() -> None:
    for where, text in snippets("json"):
        try:
            json.loads(text)
        except ValueError as exc:
            pytest.fail(f"{where}: {exc}")


def test_yaml_snippets_parse_and_reaper_files_load(tmp_path: Path) -> None:
    secret = tmp_path / "secret"
    secret.write_text("s3cret\n")
    loaded = 0
    for number, (where, text) in enumerate(snippets("yaml")):
        data = yaml.safe_load(textwrap.dedent(text))
        assert isinstance(data, dict), where
        if "harvest" not in data:
            continue  # a fragment of one (an indented block of keys)
        config = tmp_path / f"reaper_{number}.yaml"
        config.write_text(re.sub(r"\$\{file:[^}]*\}", f"${{file:{secret}}}", text))
        names = re.findall(r"\$\{env:([^}]*)\}", text)
        try:
            load(config, environ={name: "s3cret" for name in names})
        except SettingsError as exc:
            pytest.fail(f"{where}: {exc}")
        loaded += 1
    assert loaded >= 5

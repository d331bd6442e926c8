"""Resolve Maven artifacts and their runtime dependencies from Maven Central, without Maven.

    python3 deploy/local/maven.py --into DIR GROUP:ARTIFACT:VERSION ...

Copies the jars of the given artifacts and of everything they need at run time (Maven's
``dependency:copy-dependencies -DincludeScope=runtime`` of a project declaring them) into DIR.
Standard library only, so it runs before any virtualenv exists: the local services need only
Python and Java.

What it implements of Maven's model, enough for the artifacts this project runs (Kafka, Kafka
Connect, Debezium), whose sets it reproduces jar for jar: parent POMs, properties and their
interpolation, ``dependencyManagement`` with imported BOMs (applied as Maven 3 does: a direct
dependency's management governs its subtree from depth 2), scopes (compile and runtime kept,
provided, test and system dropped), optional dependencies dropped past the first level,
exclusions (with ``*``), relocations, profiles active by default, and nearest-wins conflict
resolution (first declaration at equal depth). Version ranges are refused with a message.

Every POM and jar is checked against the ``.sha1`` Maven Central publishes beside it before it is
used; verified files are kept in a local repository under ``--cache`` (default: the project's
cache directory, as deploy/local/services.sh uses), so a second resolution downloads nothing.
``MAVEN_REPOSITORY`` names another repository with Maven Central's layout (a mirror).

This file reads the POMs and walks the graph; ``maven_model.py`` beside it holds the coordinates,
dependencies and models, ``maven_repository.py`` the verified downloads.
"""

from __future__ import annotations

import argparse
import os
import re
import shutil
import sys
import xml.etree.ElementTree as ET
from collections import deque
from concurrent.futures import ThreadPoolExecutor
from pathlib import Path

from maven_model import Coordinate, Dependency, Key, Management, Model, ResolveError
from maven_repository import Repository

CENTRAL = "https://repo.maven.apache.org/maven2"
KEPT_SCOPES = {"compile", "runtime"}


# ---------------------------------------------------------------- POMs


def _strip_namespaces(root: ET.Element) -> ET.Element:
    for element in root.iter():
        if isinstance(element.tag, str) and "}" in element.tag:
            element.tag = element.tag.split("}", 1)[1]
    return root


def _text(element: ET.Element | None, name: str, default: str = "") -> str:
    found = None if element is None else element.find(name)
    return default if found is None or found.text is None else found.text.strip()


def _dependencies(section: ET.Element | None) -> list[Dependency]:
    if section is None:
        return []
    found = []
    for node in section.findall("dependency"):
        exclusions = frozenset(
            (_text(exclusion, "groupId", "*"), _text(exclusion, "artifactId", "*"))
            for exclusion in node.findall("exclusions/exclusion")
        )
        found.append(
            Dependency(
                group=_text(node, "groupId"),
                artifact=_text(node, "artifactId"),
                version=_text(node, "version"),
                scope=_text(node, "scope"),
                classifier=_text(node, "classifier"),
                type=_text(node, "type", "jar"),
                optional=_text(node, "optional") == "true",
                exclusions=exclusions,
            )
        )
    return found


class Resolver:
    def __init__(self, repository: Repository) -> None:
        self.repository = repository
        self._inherited: dict[Coordinate, Model] = {}
        self._effective: dict[Coordinate, Model] = {}

    # ---- models

    def _pom(self, coordinate: Coordinate) -> ET.Element:
        path = self.repository.fetch(coordinate.path("pom"))
        try:
            return _strip_namespaces(ET.parse(path).getroot())
        except ET.ParseError as exc:
            raise ResolveError(f"{coordinate}: unreadable POM ({exc})") from None

    def inherited(self, coordinate: Coordinate) -> Model:
        """The POM merged with its parents, not yet interpolated (Maven interpolates after
        inheritance, with the child's properties)."""
        if coordinate in self._inherited:
            return self._inherited[coordinate]
        pom = self._pom(coordinate)
        parent_node = pom.find("parent")
        if parent_node is not None:
            parent = self.inherited(
                Coordinate(*(_text(parent_node, name) for name in ("groupId", "artifactId", "version")))
            )
            properties = dict(parent.properties)
            managed = list(parent.managed)
            dependencies = list(parent.dependencies)
            group, version, parent_version = parent.group, parent.version, parent.version
        else:
            properties, managed, dependencies = {}, [], []
            group, version, parent_version = coordinate.group, coordinate.version, ""
        profiles = [p for p in pom.findall("profiles/profile") if _text(p, "activation/activeByDefault") == "true"]
        for section in [pom, *profiles]:
            declared = section.find("properties")
            for node in [] if declared is None else list(declared):
                if isinstance(node.tag, str):
                    properties[node.tag] = (node.text or "").strip()
            managed = _merged(managed, _dependencies(section.find("dependencyManagement/dependencies")))
            dependencies = _merged(dependencies, _dependencies(section.find("dependencies")))
        relocation_node = pom.find("distributionManagement/relocation")
        relocation = None
        if relocation_node is not None:
            relocation = (
                _text(relocation_node, "groupId", coordinate.group),
                _text(relocation_node, "artifactId", coordinate.artifact),
                _text(relocation_node, "version", coordinate.version),
            )
        model = Model(
            group=_text(pom, "groupId", group),
            artifact=_text(pom, "artifactId"),
            version=_text(pom, "version", version),
            parent_version=parent_version,
            properties=properties,
            managed=managed,
            dependencies=dependencies,
            relocation=relocation,
        )
        self._inherited[coordinate] = model
        return model

    def effective(self, coordinate: Coordinate) -> Model:
        """The model interpolated, with its BOM imports expanded into ``management``."""
        if coordinate in self._effective:
            return self._effective[coordinate]
        raw = self.inherited(coordinate)
        values = dict(raw.properties)
        for prefix in ("project.", "pom.", ""):
            values[f"{prefix}groupId"] = raw.group
            values[f"{prefix}artifactId"] = raw.artifact
            values[f"{prefix}version"] = raw.version
        values["project.parent.version"] = values["parent.version"] = raw.parent_version

        def expand(text: str) -> str:
            for _ in range(10):
                replaced = re.sub(r"\$\{([^}]+)\}", lambda m: values.get(m.group(1), m.group(0)), text)
                if replaced == text:
                    break
                text = replaced
            return text

        def interpolated(dependency: Dependency) -> Dependency:
            return Dependency(
                group=expand(dependency.group),
                artifact=expand(dependency.artifact),
                version=expand(dependency.version),
                scope=expand(dependency.scope),
                classifier=expand(dependency.classifier),
                type=expand(dependency.type),
                optional=dependency.optional,
                exclusions=frozenset((expand(g), expand(a)) for g, a in dependency.exclusions),
            )

        model = Model(
            group=raw.group,
            artifact=raw.artifact,
            version=raw.version,
            parent_version=raw.parent_version,
            properties=values,
            managed=[interpolated(d) for d in raw.managed],
            dependencies=[interpolated(d) for d in raw.dependencies],
            relocation=raw.relocation
            and (expand(raw.relocation[0]), expand(raw.relocation[1]), expand(raw.relocation[2])),
        )
        imports = []
        for managed in model.managed:
            if managed.scope == "import" and managed.type == "pom":
                imports.append(managed)
            else:
                model.management.setdefault(managed.key, managed)
        for bom in imports:  # declared entries win over imported ones; among imports the first wins
            imported = self.effective(Coordinate(bom.group, bom.artifact, _exact(bom.version, bom)))
            for key, managed in imported.management.items():
                model.management.setdefault(key, managed)
        for dependency in model.dependencies:
            _manage(dependency, model.management, versions_only=True)
        self._effective[coordinate] = model
        return model

    # ---- the graph

    def resolve(self, roots: list[Coordinate]) -> list[Coordinate]:
        """The runtime closure of ``roots`` in Maven's order of discovery (breadth first)."""
        chosen: dict[Key, Coordinate] = {}
        order: list[Coordinate] = []
        # (coordinate, scope, exclusions, depth, the management that governs its children)
        queue: deque[tuple[Coordinate, str, frozenset[tuple[str, str]], int, Management]]
        queue = deque((root, "compile", frozenset(), 1, {}) for root in roots)
        while queue:
            self._prefetch([entry[0] for entry in queue if entry[0].key not in chosen])
            level = queue[0][3]
            while queue and queue[0][3] == level:
                coordinate, scope, exclusions, depth, management = queue.popleft()
                model = self.effective(coordinate)
                if model.relocation is not None:
                    group, artifact, version = model.relocation
                    coordinate = Coordinate(group, artifact, version, coordinate.classifier, coordinate.type)
                    model = self.effective(coordinate)
                if coordinate.key in chosen:
                    continue
                chosen[coordinate.key] = coordinate
                order.append(coordinate)
                # Maven 3: the root's management (none here) and a direct dependency's govern
                # everything below that direct dependency.
                governing = dict(model.management) if depth == 1 else management
                for declared in model.dependencies:
                    dependency = _copy(declared)
                    _manage(dependency, governing, versions_only=False)
                    dependency_scope = dependency.scope or "compile"
                    if dependency_scope not in KEPT_SCOPES or dependency.optional:
                        continue
                    if _excluded(dependency, exclusions):
                        continue
                    if dependency.key in chosen:
                        continue
                    child = Coordinate(
                        dependency.group,
                        dependency.artifact,
                        _exact(dependency.version, dependency),
                        dependency.classifier,
                        dependency.type,
                    )
                    child_scope = "runtime" if "runtime" in (scope, dependency_scope) else "compile"
                    queue.append((child, child_scope, exclusions | dependency.exclusions, depth + 1, governing))
        return order

    def _prefetch(self, coordinates: list[Coordinate]) -> None:
        """Download a level's POMs in parallel; the walk then reads them from the cache."""
        with ThreadPoolExecutor(8) as pool:
            for future in [pool.submit(self.inherited, c) for c in dict.fromkeys(coordinates)]:
                future.result()

    def jars(self, coordinates: list[Coordinate]) -> list[Path]:
        wanted = [c for c in coordinates if c.type not in ("pom",)]
        with ThreadPoolExecutor(8) as pool:
            return list(pool.map(self._jar, wanted))

    def _jar(self, coordinate: Coordinate) -> Path:
        classifier = coordinate.classifier or ("tests" if coordinate.type == "test-jar" else "")
        return self.repository.fetch(coordinate.path("jar", classifier))


def _merged(inherited: list[Dependency], own: list[Dependency]) -> list[Dependency]:
    """A child's declaration replaces its parent's of the same key."""
    mine = {d.key for d in own}
    return [d for d in inherited if d.key not in mine] + own


def _copy(dependency: Dependency) -> Dependency:
    return Dependency(**dependency.__dict__)


def _manage(dependency: Dependency, management: Management, *, versions_only: bool) -> None:
    managed = management.get(dependency.key)
    if managed is None:
        return
    if versions_only:  # a POM's own management fills what its declarations leave out
        dependency.version = dependency.version or managed.version
        dependency.scope = dependency.scope or managed.scope
        dependency.exclusions = dependency.exclusions | managed.exclusions
        return
    if managed.version:
        dependency.version = managed.version
    if managed.scope:
        dependency.scope = managed.scope
    dependency.exclusions = dependency.exclusions | managed.exclusions


def _excluded(dependency: Dependency, exclusions: frozenset[tuple[str, str]]) -> bool:
    return any(g in ("*", dependency.group) and a in ("*", dependency.artifact) for g, a in exclusions)


def _exact(version: str, dependency: Dependency | Coordinate) -> str:
    hard = re.fullmatch(r"\[([^,\]]+)\]", version)
    if hard:
        return hard.group(1)
    if not version or "${" in version or version[0] in "[(":
        raise ResolveError(
            f"{dependency.group}:{dependency.artifact}: version '{version or '(none)'}' is not a fixed version"
        )
    return version


def _coordinate(text: str) -> Coordinate:
    parts = text.split(":")
    if len(parts) != 3 or not all(parts):
        raise argparse.ArgumentTypeError(f"expected GROUP:ARTIFACT:VERSION, got '{text}'")
    return Coordinate(*parts)


def main(argv: list[str] | None = None) -> int:
    default_cache = Path(
        os.environ.get("HARVESTER_CACHE_DIR")
        or Path(os.environ.get("XDG_CACHE_HOME") or Path.home() / ".cache") / "outbox-harvester"
    )
    parser = argparse.ArgumentParser(description="Copy artifacts and their runtime dependencies into a directory.")
    parser.add_argument("--into", type=Path, required=True, help="directory that receives the jars (emptied first)")
    parser.add_argument(
        "--cache", type=Path, default=default_cache / "maven", help="local repository of verified files"
    )
    parser.add_argument("artifacts", nargs="+", type=_coordinate, metavar="GROUP:ARTIFACT:VERSION")
    options = parser.parse_args(argv)
    resolver = Resolver(Repository(options.cache, os.environ.get("MAVEN_REPOSITORY") or CENTRAL))
    try:
        jars = resolver.jars(resolver.resolve(options.artifacts))
    except ResolveError as exc:
        print(f"maven.py: {exc}", file=sys.stderr)
        return 1
    shutil.rmtree(options.into, ignore_errors=True)
    options.into.mkdir(parents=True)
    for jar in jars:
        shutil.copyfile(jar, options.into / jar.name)
    return 0


if __name__ == "__main__":
    sys.exit(main())

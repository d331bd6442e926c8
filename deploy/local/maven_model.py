"""What deploy/local/maven.py resolves: Maven coordinates, declared dependencies and POM models,
and the error that ends a resolution."""

from __future__ import annotations

from dataclasses import dataclass, field

Key = tuple[str, str, str, str]  # group, artifact, classifier, type: what conflict resolution compares
Management = dict[Key, "Dependency"]


class ResolveError(Exception):
    """Resolution cannot go on; the message says why (one line)."""


@dataclass(frozen=True)
class Coordinate:
    group: str
    artifact: str
    version: str
    classifier: str = ""
    type: str = "jar"

    @property
    def key(self) -> Key:
        return (self.group, self.artifact, self.classifier, self.type)

    def path(self, extension: str, classifier: str = "") -> str:
        suffix = f"-{classifier}" if classifier else ""
        return (
            f"{self.group.replace('.', '/')}/{self.artifact}/{self.version}/"
            f"{self.artifact}-{self.version}{suffix}.{extension}"
        )

    def __str__(self) -> str:
        return f"{self.group}:{self.artifact}:{self.version}"


@dataclass
class Dependency:
    group: str
    artifact: str
    version: str
    scope: str
    classifier: str
    type: str
    optional: bool
    exclusions: frozenset[tuple[str, str]]

    @property
    def key(self) -> Key:
        return (self.group, self.artifact, self.classifier, self.type)


@dataclass
class Model:
    """A POM after inheritance: raw strings until ``effective`` interpolates them."""

    group: str
    artifact: str
    version: str
    parent_version: str
    properties: dict[str, str]
    managed: list[Dependency]
    dependencies: list[Dependency]
    relocation: tuple[str, str, str] | None = None
    # Managed entries after interpolation and BOM imports, by key (the first one wins).
    management: Management = field(default_factory=dict)

"""Validation and quoting of SQL identifiers that come from configuration.

A table name from a config file is never spliced into SQL as text: it is parsed into at most two
parts (schema and table), each checked against a conservative pattern, then quoted by psycopg.
"""

from __future__ import annotations

import re
from dataclasses import dataclass

from psycopg import sql

_PART = re.compile(r"^[A-Za-z_][A-Za-z0-9_]{0,62}$")


class IdentifierError(ValueError):
    """A configured SQL identifier is not acceptable."""


@dataclass(frozen=True, slots=True)
class TableName:
    """A validated, optionally schema-qualified table name."""

    schema: str | None
    name: str

    @classmethod
    def parse(cls, text: str) -> TableName:
        """Parse ``table`` or ``schema.table``; raise :class:`IdentifierError` on anything else."""
        parts = text.split(".")
        if len(parts) > 2 or not all(_PART.match(p) for p in parts):
            raise IdentifierError(
                f"invalid table name {text!r}: expected 'table' or 'schema.table', each part a letter or "
                "underscore followed by up to 62 letters, digits or underscores"
            )
        if len(parts) == 2:
            return cls(schema=parts[0], name=parts[1])
        return cls(schema=None, name=parts[0])

    @property
    def qualified(self) -> str:
        """The unquoted dotted name, for logs, metrics labels and catalog look-ups."""
        return f"{self.schema}.{self.name}" if self.schema else self.name

    @property
    def quoted(self) -> str:
        """The double-quoted name as SQL text (safe: each part matched the identifier pattern)."""
        return ".".join(f'"{p}"' for p in (self.schema, self.name) if p)

    @property
    def ident(self) -> sql.Composable:
        """The quoted identifier for use in a composed statement."""
        if self.schema:
            return sql.Identifier(self.schema, self.name)
        return sql.Identifier(self.name)

    def derived(self, suffix: str) -> TableName:
        """A sibling object name in the same schema (``<name>_<suffix>``), truncated to 63 bytes."""
        return TableName(self.schema, f"{self.name}_{suffix}"[:63])

    def __str__(self) -> str:
        return self.qualified

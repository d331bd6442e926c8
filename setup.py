"""The one part of the build that pyproject.toml cannot state: the migrations' home is the top-level
``sql/``, and the wheel installs it as the package data ``harvester/postgres/sql/``, where
``harvester.postgres.schema.migrations`` reads it. The rest of the build's configuration is in pyproject.toml."""

from setuptools import find_packages, setup

setup(
    packages=[*find_packages(include=["harvester", "harvester.*", "leader", "leader.*"]), "harvester.postgres.sql"],
    package_dir={"harvester.postgres.sql": "sql"},
)

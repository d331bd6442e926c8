"""The package's shape: what applications import stays light, and the public names resolve."""

from __future__ import annotations

import json
import subprocess
import sys

import pytest

import harvester
import leader

pytestmark = pytest.mark.unit

HEAVY = (
    "confluent_kafka",
    "pyspark",
    "opentelemetry",
    "harvester.otel",
    "harvester.core.engine",
    "harvester.harvester",
    "leader.election",
)


def loaded_after(code: str) -> set[str]:
    """The modules a fresh interpreter holds after running ``code``."""
    probe = f"{code}\nimport json, sys\nprint(json.dumps(sorted(sys.modules)))"
    out = subprocess.run([sys.executable, "-c", probe], check=True, capture_output=True, text=True).stdout
    return set(json.loads(out.splitlines()[-1]))


@pytest.mark.parametrize(
    "code",
    [
        "from harvester import OutboxRecord, Stasher, stash",
        "from harvester import AsyncStasher",
        "import harvester.client",
        "from harvester.client import AsyncStasher, Identity, OutboxRecord, Stasher",
        "from harvester import DedupState",
        "from leader.events import LeaderAcquired",
    ],
)
def test_the_client_api_does_not_load_the_engine_kafka_spark_or_opentelemetry(code: str) -> None:
    loaded = loaded_after(code)
    assert sorted(m for m in loaded if m.startswith(HEAVY)) == []


def test_the_harvester_import_still_loads_what_it_needs() -> None:
    assert {"confluent_kafka", "harvester.core.engine"} <= loaded_after("from harvester import Harvester")


@pytest.mark.parametrize("package", [harvester, leader])
def test_every_public_name_resolves(package: object) -> None:
    names = package.__all__  # type: ignore[attr-defined]
    assert set(names) == {*package._EXPORTS, *(["__version__"] if package is harvester else [])}  # type: ignore[attr-defined]
    for name in names:
        assert getattr(package, name) is not None
    with pytest.raises(AttributeError):
        package.no_such_name  # type: ignore[attr-defined]  # noqa: B018


def test_the_old_dedup_paths_are_the_client_reader_and_state() -> None:
    from harvester.client.dedup import DedupReader, DedupState
    from harvester.client.dedup_state import DedupState as State
    from harvester.dedup import DedupReader as Old
    from harvester.dedup import DedupState as OldState

    assert Old is DedupReader
    assert OldState is DedupState is State is harvester.DedupState

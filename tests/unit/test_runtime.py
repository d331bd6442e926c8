"""The reaper's process-wide settings (harvester.runtime)."""

from __future__ import annotations

import gc
from collections.abc import Iterator

import pytest

from harvester.runtime import GC_THRESHOLDS, tune_garbage_collector

pytestmark = pytest.mark.unit


@pytest.fixture
def collector() -> Iterator[None]:
    before = gc.get_threshold()
    yield
    gc.unfreeze()
    gc.set_threshold(*before)


@pytest.mark.usefixtures("collector")
def test_the_collector_is_tuned_for_a_harvesting_process() -> None:
    tune_garbage_collector()
    assert gc.get_threshold() == GC_THRESHOLDS
    assert gc.get_freeze_count() > 0  # start-up's objects are left out of every collection

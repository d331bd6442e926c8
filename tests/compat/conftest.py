"""Keep the logging configuration of a ``reaper`` command run in-process from leaking into other tests."""

from __future__ import annotations

from collections.abc import Iterator

import pytest

from harvester.daemon import logs


@pytest.fixture(autouse=True)
def _reset_logging() -> Iterator[None]:
    yield
    logs.reset()

"""The secure services, started once per session by the worker that runs tests/secure (one group)."""

from __future__ import annotations

import pytest

from tests.secure import services


@pytest.fixture(scope="session")
def secure() -> None:
    services.start()

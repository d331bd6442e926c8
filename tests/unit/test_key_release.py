"""``keyRelease``: when a key's next record may go out, as the harvester is composed from its
settings (the policies themselves: tests/unit/test_gate.py, tests/unit/test_engine_algorithm.py)."""

from __future__ import annotations

import pytest
from pydantic import ValidationError

from harvester.compose import source
from harvester.config import HarvesterConfig

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("setting", "at_ack"),
    [
        ({}, True),
        ({"deadLetterPolicy": "hold_key"}, False),
        ({"keyRelease": "purged"}, False),
        ({"keyRelease": "acknowledged"}, True),
    ],
)
def test_the_polling_store_releases_a_key_as_set(setting: dict[str, str], at_ack: bool) -> None:
    store = source(HarvesterConfig.model_validate(setting)).store
    try:
        assert store.release_on_ack is at_ack
    finally:
        store.close()


def test_the_log_source_refuses_a_key_released_at_its_purge() -> None:
    with pytest.raises(ValidationError, match="keyRelease 'purged' is mark_purge's"):
        HarvesterConfig.model_validate({"source": "log", "keyRelease": "purged"})


def test_held_dead_letter_keys_refuse_a_key_released_at_its_acknowledgement() -> None:
    with pytest.raises(ValidationError, match="use keyRelease 'purged'"):
        HarvesterConfig.model_validate({"keyRelease": "acknowledged", "deadLetterPolicy": "hold_key"})

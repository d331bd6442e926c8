"""Helpers the process-level tests and the bench measure with."""

from __future__ import annotations

import pytest

from examples.leader_demo import DemoSettings, longest_overlap

pytestmark = pytest.mark.unit


def test_longest_overlap_of_terms() -> None:
    assert longest_overlap([[(0.0, 5.0)], [(5.0, 9.0)], [(9.0, 10.0)]]) == 0.0
    assert longest_overlap([[(0.0, 5.0), (8.0, 9.0)], [(4.0, 8.5)]]) == pytest.approx(1.0)
    # Overlapping pairs that chain without a gap count as one continuous overlap.
    assert longest_overlap([[(0.0, 10.0)], [(1.0, 3.0), (4.0, 7.0)], [(2.5, 4.5)]]) == pytest.approx(6.0)


def test_settings_round_trip_through_arguments() -> None:
    args = DemoSettings(session_timeout=8.0).args()
    assert args[args.index("--session-timeout") + 1] == "8.0"
    assert len(args) == 2 * len(DemoSettings.__dataclass_fields__)

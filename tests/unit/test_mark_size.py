"""Adaptive batching: marks grow while a backlog lasts and shrink back when it is gone."""

from __future__ import annotations

import pytest

from harvester import Limits
from harvester.core.engine import MarkSize

pytestmark = pytest.mark.unit


def test_auto_marks_double_while_full_and_fall_back_when_not() -> None:
    size = MarkSize(Limits())
    asked = []
    for returned in (100, 200, 400, 500, 500, 37, 100):
        asked.append(size.records)
        size.observe(returned)
    assert asked == [100, 200, 400, 500, 500, 500, 100]
    assert size.records == 200


def test_a_configured_mark_size_is_used_as_it_is() -> None:
    size = MarkSize(Limits(mark_query_records=250))
    for returned in (250, 250, 3, 0):
        assert size.records == 250
        size.observe(returned)


def test_auto_in_flight_window_and_a_configured_one() -> None:
    assert Limits().in_flight_bound == 5000
    assert Limits(max_in_flight_records=1000).in_flight_bound == 1000

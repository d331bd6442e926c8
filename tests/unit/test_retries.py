"""The store retries' clocks: how long the database path has failed (what makes a leader yield) is
dated from when the failed call began, never before the last success; the standby's probe stalls
like any statement and any success clears it."""

from __future__ import annotations

import time
from datetime import timedelta

import pytest

from harvester import Limits
from harvester.core.metrics import HarvesterMetrics
from harvester.core.protocols import StoreError, StoreUnreachableError
from harvester.core.retries import PROBE, StoreRetries

pytestmark = pytest.mark.unit

LONG_AGO = 1000.0  # seconds: far more than any pause of a loaded machine between two lines


def retries(stall_timeout: timedelta = timedelta(minutes=5)) -> StoreRetries:
    return StoreRetries(Limits(stall_timeout=stall_timeout), HarvesterMetrics())


def test_a_timed_out_statement_dates_the_failure_from_when_it_was_sent() -> None:
    r = retries()
    r.failed("mark", StoreUnreachableError("no answer", since=time.monotonic() - LONG_AGO))
    assert r.unreachable_seconds() >= LONG_AGO
    r.succeeded("mark")
    assert r.unreachable_seconds() == 0.0


def test_the_failure_is_not_dated_before_the_last_success() -> None:
    r = retries()
    r.succeeded("purge")  # another thread's statement got through while this one waited
    r.failed("mark", StoreUnreachableError("no answer", since=time.monotonic() - LONG_AGO))
    assert r.unreachable_seconds() < LONG_AGO


def test_a_refused_statement_is_no_path_failure() -> None:
    r = retries()
    r.failed("dead_letter", StoreError("value too long"))
    assert r.unreachable_seconds() == 0.0


def test_the_probe_stalls_and_any_success_clears_it() -> None:
    r = retries(stall_timeout=timedelta(0))
    assert r.failed(PROBE, StoreUnreachableError("refused"), retry_in=5.0) == 5.0  # the caller's pace
    stall = r.stalled()
    assert stall is not None and stall.operation == PROBE
    r.succeeded("term_start")  # the standby became leader and reached the database
    assert r.stalled() is None
    assert r.unreachable_seconds() == 0.0

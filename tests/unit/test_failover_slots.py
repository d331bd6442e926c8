"""What the primary's view of the log source's slot makes of a failover (issue 41): each state's
reason with its fix, and the table-less outbox's refusal, which names the risk and the setting."""

from __future__ import annotations

import pytest

from harvester.postgres.log.logical import Failover

pytestmark = pytest.mark.unit


@pytest.mark.parametrize(
    ("state", "reason"),
    [
        (Failover("s", 160004, False, (), ()), "has no copy on a standby before PostgreSQL 17"),
        (Failover("s", 180006, False, ("sb",), ("sb",)), "ALTER_REPLICATION_SLOT s (FAILOVER true)"),
        (Failover("s", 180006, True, (), ()), "synchronized_standby_slots is empty"),
        (Failover("s", 180006, True, ("sb",), ()), "sync_replication_slots = on and a dbname in primary_conninfo"),
    ],
)
def test_an_unprotected_slot_says_why_with_the_fix(state: Failover, reason: str) -> None:
    assert not state.protected
    problem = state.problem()
    assert problem is not None and reason in problem
    assert state.describe() == f"not protected: {problem}"


def test_a_failover_slot_synchronized_by_a_standby_is_protected() -> None:
    state = Failover("s", 170000, True, ("sb", "other"), ("sb",))
    assert state.protected and state.problem() is None
    assert state.describe().startswith("failover slot, synchronized by the standby on sb ")

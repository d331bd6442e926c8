"""The plan made ahead (harvester/spark/drain/ahead.py), with a plan function standing in for the
store: taken only for the same term and the same ids to skip, trimmed, topped up. The drain tests
(tests/spark_drain) run it against PostgreSQL and Spark; test_fence.py a plan made ahead under a
term taken since."""

from __future__ import annotations

from harvester.spark.drain.ahead import PlanAhead, Work


class Outbox:
    """Pending ids 1..n; ``plan`` is what the store's ``pending`` answers."""

    def __init__(self, n: int) -> None:
        self.ids = list(range(1, n + 1))
        self.calls: list[tuple[int, list[int], int]] = []

    def plan(self, shard: int, skip: list[int], limit: int) -> list[int]:
        self.calls.append((shard, skip, limit))
        return [i for i in self.ids if i not in skip][:limit]


def test_a_plan_made_ahead_is_taken_trimmed_or_topped_up() -> None:
    outbox, ahead = Outbox(30), PlanAhead()
    ahead.start({0: Work(epoch=5, skip=[1, 2], limit=10)}, outbox.plan)
    outbox.calls.clear()
    assert ahead.take(0, 5, [1, 2], 4, outbox.plan) == [3, 4, 5, 6]  # trimmed: the rest is planned later
    assert outbox.calls == [(0, [], 0)]  # the store asked all the same: a fenced term raises there
    ahead.start({0: Work(5, [1, 2], 10)}, outbox.plan)
    outbox.calls.clear()
    assert ahead.take(0, 5, [1, 2], 15, outbox.plan) == list(range(3, 18))  # topped up past what was made
    assert outbox.calls == [(0, [1, 2, *range(3, 13)], 5)]
    ahead.start({0: Work(5, [1, 2], 10)}, outbox.plan)
    outbox.ids.insert(0, 0)  # a transaction that committed late, with a lower id, while a batch ran
    assert ahead.take(0, 5, [1, 2], 12, outbox.plan) == [0, *range(3, 14)]  # found by the top-up, sorted


def test_a_plan_made_ahead_under_another_term_or_skip_is_not_taken() -> None:
    outbox, ahead = Outbox(30), PlanAhead()
    ahead.start({0: Work(5, [1], 10), 1: Work(5, [1], 10)}, outbox.plan)
    assert ahead.take(0, 6, [1], 10, outbox.plan) is None  # a newer term: its own plan
    assert ahead.take(1, 5, [], 10, outbox.plan) is None  # the batch before was not delivered: not skipped
    assert ahead.take(1, 5, [1], 10, outbox.plan) is None  # taken once
    assert ahead.take(2, 5, [1], 10, outbox.plan) is None  # never planned ahead


def test_a_failed_plan_ahead_leaves_the_shard_to_the_next_plan() -> None:
    def broken(shard: int, skip: list[int], limit: int) -> list[int]:
        raise RuntimeError("the server went away")

    ahead = PlanAhead()
    ahead.start({0: Work(5, [], 10)}, broken)
    assert ahead.take(0, 5, [], 10, broken) is None

"""The log source over a table dead-letters a poison record among good ones, in both delivery modes:
the record goes to the dead-letter table with its reason, alone (the next record of its key, which
shared its batch, is delivered), counts as done for the slot (which moves on past it), is attempted
exactly as many times as its dead letter says and never after, nothing else stalls, and
``reaper dlq replay`` delivers it once its cause is fixed. The store alone shows the bookkeeping
under it: a dead letter counts as done for the slot and for the next term."""

from __future__ import annotations

import os
from collections.abc import Callable
from pathlib import Path
from uuid import uuid4

import pytest
import structlog
import yaml

from harvester import HarvesterConfig
from harvester.compose import log_store
from harvester.core.records import Failure
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.schema.identifiers import TableName
from tests.deadletter.test_poison import FAST, dead_letters
from tests.engine.workload import check, insert, wait_drained, wait_until
from tests.log.conftest import slot_position
from tests.log.test_log_source import COMMITTED, DELIVERY, at_or_after, lsn, mark_all
from tests.support.harvesters import HarvesterFactory
from tests.support.kafka import read_messages, set_topic_config, text
from tests.support.reaper import run_reaper
from tests.support.services import Services

pytestmark = pytest.mark.integration


@DELIVERY
def test_a_poison_record_is_dead_lettered_the_slot_moves_past_it_and_replay_delivers_it(
    services: Services,
    logical_dsn: str,
    log_outbox: TableName,
    topics: Callable[..., str],
    make_log_harvester: HarvesterFactory,
    tmp_path: Path,
    delivery: str,
) -> None:
    good, small = topics(), topics(**{"max.message.bytes": "1024"})
    big = "p:0:" + os.urandom(2000).hex()  # larger than the small topic takes, compressed too
    rows = [(good, f"g{i % 4}", f"g{i % 4}:{i // 4}") for i in range(40)]
    # The poison among good ones in one transaction, with the next record of its key (in its batch,
    # which Kafka refuses whole: the follower is retried alone and delivered).
    follower = [(small, "p", "p:1")]
    with structlog.testing.capture_logs() as logs:
        make_log_harvester(
            delivery=delivery, producer=FAST, max_attempts=2, retry_backoff="10ms", max_retry_backoff="50ms"
        )
        insert(logical_dsn, log_outbox, rows[:20])
        insert(logical_dsn, log_outbox, [rows[20], (small, "p", big), *follower, rows[21]])
        after_poison = lsn(logical_dsn)
        insert(logical_dsn, log_outbox, rows[22:])
        verdict = check(read_messages(services.bootstrap, [good], 40, **COMMITTED), {f"g{i}": 10 for i in range(4)})
        assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
        if delivery == "exactly_once":
            assert verdict.duplicates == 0
        assert wait_drained(logical_dsn, log_outbox) == 0  # the poison row moved to the dead-letter table
        [(poison, (reason, attempts))] = dead_letters(logical_dsn, log_outbox).items()
        assert reason == "msg_size_too_large" and attempts == 2
        # Done for the slot: it moves on past the poison's transaction.
        assert wait_until(lambda: at_or_after(logical_dsn, slot_position(logical_dsn, log_outbox), after_poison))
        followed = [v for _, _, v in follower]
        small_values = [text(m.value()) for m in read_messages(services.bootstrap, [small], 1, **COMMITTED)]
        assert small_values == followed
    # Attempted (alone, each refusal counted) as many times as its dead letter says, never after it.
    events = [e["event"] for e in logs if e.get("id") == poison and e["event"] in ("delivery_failed", "dead_lettered")]
    assert events[-1] == "dead_lettered" and events.count("dead_lettered") == 1
    assert sum(1 for e in logs if e.get("id") == poison and e.get("alone")) == attempts

    set_topic_config(services.bootstrap, small, "max.message.bytes", "1048576")
    config = tmp_path / "reaper.yaml"
    harvest = {"dataSource": logical_dsn, "outboxTable": log_outbox.qualified, "source": "log"}
    config.write_text(yaml.safe_dump({"harvest": harvest}))
    replayed = run_reaper("dlq", "replay", str(poison), "--yes", "-f", str(config))
    assert replayed.returncode == 0, replayed.stderr
    assert wait_drained(logical_dsn, log_outbox) == 0
    values = [text(m.value()) for m in read_messages(services.bootstrap, [small], len(follower) + 1, **COMMITTED)]
    assert values == [*followed, big]
    assert dead_letters(logical_dsn, log_outbox) == {}


@pytest.mark.parametrize("delivery", ["purge", "purge_checkpointed"])
def test_a_dead_lettered_record_is_done_for_the_slot_and_the_next_term(
    logical_dsn: str, log_outbox: TableName, delivery: str
) -> None:
    """The store alone (each delivery mode's purge): a record dead-lettered amid delivered ones of
    its transaction counts as done, so the slot moves past that transaction, and the next term
    (a restart) hands out only what came after it."""
    config = HarvesterConfig(outbox_table=log_outbox.qualified)
    setup = LogSetup(log_outbox, config.slot, config.publication)
    insert(logical_dsn, log_outbox, [("t", "a", "a:0"), ("t", "p", "poison"), ("t", "b", "b:0")])
    after_poison = lsn(logical_dsn)
    store, leader = log_store(logical_dsn, setup), uuid4()
    try:
        store.prepare()
        store.acquire(leader)
        records = mark_all(store, leader, 3)
        [poison] = [r for r in records if r.key == "p"]
        delivered = [r.id for r in records if r is not poison]
        if delivery == "purge":
            store.purge(delivered)
        else:
            store.purge_checkpointed(delivered, 1)
        store.dead_letter([Failure(poison.id, "p", "msg_size_too_large", "refused", 2, None)], leader)
        assert dead_letters(logical_dsn, log_outbox) == {poison.id: ("msg_size_too_large", 2)}

        def moved() -> bool:
            """Confirmed by the next (idle) marks."""
            return not store.mark(leader, 10) and at_or_after(
                logical_dsn, slot_position(logical_dsn, log_outbox), after_poison
            )

        assert wait_until(moved, timeout=15)
    finally:
        store.close()
    insert(logical_dsn, log_outbox, [("t", "p", "p:1")])
    store, leader = log_store(logical_dsn, setup), uuid4()
    try:
        store.prepare()
        store.acquire(leader)
        assert [r.value for r in mark_all(store, leader, 1)] == [b"p:1"]
    finally:
        store.close()

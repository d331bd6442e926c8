"""Sharded harvesting across real reaper processes on real Kafka and PostgreSQL: shards spread over
the members, move when a member joins, and keep every record and every key's order across the
move; another number of shards is refused; one shard harvests a plain goharvest table."""

from __future__ import annotations

import itertools
import json
import os
import signal
import subprocess
import sys
import threading
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from psycopg import sql

from harvester import OutboxRecord, Stasher
from harvester.core.identity import Identity
from harvester.core.shards import shard_of
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import fence_table
from tests.chaos import audit
from tests.engine.workload import check, wait_drained, wait_until
from tests.proc.processes import HarvesterProcess, harvester_spec
from tests.support.kafka import consumed_headers, delete_topics, read_messages
from tests.support.names import unique
from tests.support.paths import ROOT
from tests.support.postgres import create_goharvest_outbox
from tests.support.services import Services

pytestmark = pytest.mark.integration

SHARDS = 4
Spawn = Callable[..., HarvesterProcess]


@pytest.fixture
def group() -> str:
    """The leader group of this test's harvester processes."""
    return unique("group")


@pytest.fixture
def spawn(services: Services, outbox: TableName, group: str) -> Iterator[Spawn]:
    """Factory of harvester processes of one group over this test's outbox; stopped afterwards."""
    made: list[HarvesterProcess] = []

    def make(name: str, table: TableName = outbox, **settings: object) -> HarvesterProcess:
        spec = harvester_spec(services.pg_dsn, services.bootstrap, table, group, name, **settings)
        made.append(HarvesterProcess(spec))
        return made[-1]

    yield make
    for p in made:
        p.terminate()
    delete_topics(services.bootstrap, [f"{group}.neli"])


def write_until(dsn: str, table: TableName, topic: str, written: dict[str, int], stop: threading.Event) -> None:
    """Write one record of every key of ``written`` per transaction round until ``stop``; values
    are ``<key>:<seq>``, and ``written`` counts each key's records."""
    stasher = Stasher(table)
    with psycopg.connect(dsn) as conn:
        while not stop.is_set():
            with conn.transaction():
                stasher.stash(conn, [OutboxRecord(topic=topic, key=k, value=f"{k}:{n}") for k, n in written.items()])
            for k in written:
                written[k] += 1
            time.sleep(0.02)


def leading(p: HarvesterProcess) -> set[int]:
    """The shards ``p`` leads now, from its leader events."""
    led: set[int] = set()
    for e in list(p.events):
        if e["event"] == "LeaderAcquired":
            led.add(int(e["shard"]))
        elif e["event"] in ("LeaderRevoked", "LeaderFenced"):
            led.discard(int(e["shard"]))
    return led


def spread(members: list[HarvesterProcess]) -> bool:
    sets = [leading(m) for m in members]
    return all(sets) and sorted(s for led in sets for s in led) == list(range(SHARDS))


def terms(members: list[HarvesterProcess]) -> dict[int, list[tuple[float, float, str]]]:
    """Per shard, every term as (start, end, member) from the members' event times."""
    out: dict[int, list[tuple[float, float, str]]] = defaultdict(list)
    for m in members:
        began: dict[int, float] = {}
        for e in list(m.events):
            if e["event"] == "LeaderAcquired":
                began[int(e["shard"])] = float(e["t"])
            elif e["event"] in ("LeaderRevoked", "LeaderFenced") and int(e["shard"]) in began:
                out[int(e["shard"])].append((began.pop(int(e["shard"])), float(e["t"]), m.name))
        for shard, start in began.items():
            out[shard].append((start, float("inf"), m.name))
    return out


def test_a_joining_member_takes_shards_without_two_leaders_and_nothing_is_lost(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    outbox: TableName,
    topics: Callable[..., str],
    spawn: Spawn,
) -> None:
    topic = topics(partitions=3)
    # Small batches keep the drain going while the shards move.
    limits = {"mark_query_records": 20, "max_in_flight_records": 40}
    first, second = spawn("a", shards=SHARDS, limits=limits), spawn("b", shards=SHARDS, limits=limits)
    assert wait_until(lambda: spread([first, second]), timeout=90)
    assert len(leading(first)) == len(leading(second)) == 2
    stop, expected = threading.Event(), {f"k{i}": 0 for i in range(100)}
    writer = threading.Thread(target=write_until, args=(services.pg_dsn, outbox, topic, expected, stop))
    writer.start()
    assert wait_until(lambda: min(expected.values()) >= 5)
    # Every shard publishes under its first term before the third member joins (its keys' rows up to
    # now purged, so acknowledged): a shard that moves then has records of both terms.
    head = pg.execute(sql.SQL("SELECT max(id) FROM {}").format(outbox.ident)).fetchone()
    up_to_head = sql.SQL("SELECT count(*) FROM {} WHERE id <= %s").format(outbox.ident)
    assert head is not None
    assert wait_until(lambda: pg.execute(up_to_head, (head[0],)).fetchone() == (0,), timeout=90)
    before = [leading(first), leading(second)]
    third = spawn("c", shards=SHARDS, limits=limits)
    members = [first, second, third]
    assert wait_until(lambda: spread(members), timeout=90)
    written = sum(expected.values())
    assert wait_until(lambda: sum(expected.values()) >= written + 500)  # still flowing after the move
    stop.set()
    writer.join()
    assert wait_drained(services.pg_dsn, outbox, timeout=120) == 0
    taken = leading(third)
    assert taken and leading(first) | leading(second) | taken == set(range(SHARDS))
    assert all(leading(m) <= b for m, b in zip(members[:2], before, strict=True))  # sticky: nobody else moved
    # Never two leaders of one shard at once: each shard's terms follow one another.
    for shard, spans in terms(members).items():
        spans.sort()
        for (_, end, who), (start, _, nxt) in itertools.pairwise(spans):
            assert end <= start, f"shard {shard}: {who} led until {end}, {nxt} from {start}"
    fence = pg.execute(
        sql.SQL("SELECT shard, shards, epoch FROM {} WHERE outbox_table = %s ORDER BY shard").format(
            fence_table(outbox).ident
        ),
        (outbox.qualified,),
    ).fetchall()
    assert [(r[0], r[1]) for r in fence] == [(s, SHARDS) for s in range(SHARDS)]
    got = read_messages(services.bootstrap, [topic], sum(expected.values()), timeout=120)
    verdict = check(got, expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    # Every epoch is one shard's term, and a key's records go out under ever newer terms of its
    # shard: the term that published a key's record was the only leader of that shard then.
    shard_of_epoch: dict[int, int] = {}
    last_epoch: dict[str, int] = {}
    for message in got:
        identity = Identity.from_headers(consumed_headers(message))
        assert identity is not None
        key = (message.key() or b"").decode()
        assert shard_of_epoch.setdefault(identity.epoch, shard_of(key, SHARDS)) == shard_of(key, SHARDS)
        assert identity.epoch >= last_epoch.get(key, 0), f"{key}: epoch {identity.epoch} after {last_epoch[key]}"
        last_epoch[key] = identity.epoch
    moved = {s for s in range(SHARDS) if sum(1 for e, sh in shard_of_epoch.items() if sh == s) > 1}
    assert moved  # some shard published under two terms: it moved while records flowed
    for p in members:
        exit_line = p.terminate()
        tail = "".join(p.log[-400:])  # a process stuck at its stop: every thread's stack (terminate)
        assert exit_line is not None, f"{p.name} (exit code {p.proc.returncode}) printed no exit line:\n{tail}"
        assert exit_line["fenced_statements"] == 0, exit_line


def test_a_reaper_with_another_number_of_shards_is_refused(
    services: Services, outbox: TableName, spawn: Spawn, tmp_path: Path
) -> None:
    leader = spawn("a", shards=SHARDS)
    assert leader.wait_for("LeaderAcquired", timeout=60)
    assert wait_until(lambda: len(leading(leader)) == SHARDS, timeout=60)
    path = tmp_path / "reaper.yaml"
    path.write_text(
        f"harvest:\n  dataSource: {services.pg_dsn}\n  outboxTable: {outbox.qualified}\n"
        f"  leaderGroupID: {unique('other')}\n  shards: 2\n"
        f"  baseKafkaConfig:\n    bootstrap.servers: '{services.bootstrap}'\nhttp:\n  enabled: false\n",
        "utf-8",
    )
    run = subprocess.run(
        [sys.executable, "-m", "harvester.daemon.cli", "run", "-f", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert run.returncode == 2
    lines = run.stderr.strip().splitlines()
    assert lines[-1] == (
        f"reaper: error: harvest.shards is 2 but {outbox.qualified} is harvested with 4 shards: every reaper "
        "of a group must use the same number (to change it, see docs/sharding.md)"
    ), run.stderr


def test_one_shard_harvests_a_plain_goharvest_table(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    topics: Callable[..., str],
    spawn: Spawn,
) -> None:
    table = TableName(schema, "goharvest_outbox")
    create_goharvest_outbox(pg, table)
    topic = topics()
    rows = [(topic, f"k{i % 10}", f"k{i % 10}:{i // 10}") for i in range(200)]
    pg.execute(
        sql.SQL(
            "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys,"
            " kafka_header_values) SELECT now(), t, k, v, '{{}}', '{{}}' FROM unnest(%s::text[], %s::text[],"
            " %s::text[]) AS u(t, k, v)"
        ).format(table.ident),
        ([r[0] for r in rows], [r[1] for r in rows], [r[2] for r in rows]),
    )
    h = spawn("solo", table=table)
    assert h.wait_for("LeaderAcquired", timeout=60)
    assert wait_drained(services.pg_dsn, table) == 0
    verdict = check(read_messages(services.bootstrap, [topic], 200), {f"k{i}": 20 for i in range(10)})
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    fence = pg.execute(
        sql.SQL("SELECT shard, shards FROM {} WHERE outbox_table = %s").format(fence_table(table).ident),
        (table.qualified,),
    ).fetchall()
    assert fence == [(0, 1)]
    indexes = pg.execute(
        "SELECT count(*) FROM pg_indexes WHERE schemaname = %s AND indexname LIKE '%%shard%%'", (schema,)
    ).fetchone()
    assert indexes == (0,)  # one shard needs no index of its own


def test_a_paused_shard_leader_resumes_as_a_zombie_and_changes_nothing(
    services: Services,
    outbox: TableName,
    topics: Callable[..., str],
    spawn: Spawn,
) -> None:
    """Every change of the outbox, its fence and dead-letter rows is audited (tests/chaos/audit.py,
    as in the chaos runs): none is made by a process after another's term of its shard began."""
    topic = topics(partitions=3)
    trail = audit.install(services.pg_dsn, outbox, shards=SHARDS)
    limits = {"mark_query_records": 20, "max_in_flight_records": 40}
    paused, other = spawn("a", shards=SHARDS, limits=limits), spawn("b", shards=SHARDS, limits=limits)
    assert wait_until(lambda: spread([paused, other]), timeout=90)
    held = leading(paused)
    stop, expected = threading.Event(), {f"k{i}": 0 for i in range(100)}
    writer = threading.Thread(target=write_until, args=(services.pg_dsn, outbox, topic, expected, stop))
    writer.start()
    try:
        assert wait_until(lambda: min(expected.values()) >= 5)
        paused_at = time.time()
        os.kill(paused.proc.pid, signal.SIGSTOP)
        # The coordinator expels the silent member and hands its shards over.
        assert wait_until(lambda: leading(other) == set(range(SHARDS)), timeout=60)
        os.kill(paused.proc.pid, signal.SIGCONT)
        # Resumed, it finds its heartbeats overdue and its shards gone: every term it held is fenced.
        assert wait_until(
            lambda: (
                {int(e["shard"]) for e in paused.events if e["event"] == "LeaderFenced" and e["t"] > paused_at} >= held
            ),
            timeout=30,
        )
        written = sum(expected.values())
        assert wait_until(lambda: sum(expected.values()) >= written + 500)
    finally:
        stop.set()
        writer.join()
    assert wait_drained(services.pg_dsn, outbox, timeout=120) == 0
    got = read_messages(services.bootstrap, [topic], sum(expected.values()), timeout=120)
    verdict = check(got, expected)
    assert verdict.lost == [] and verdict.out_of_order == [] and verdict.unexpected == 0
    assert not leading(paused) & leading(other)
    history = audit.history(services.pg_dsn, trail)
    # The paused leader purged before its pause (so the audit is not vacuous) and nothing past a fence.
    assert any(c.kind == "DELETE" and c.app == "outbox-harvester a" for c in history)
    assert audit.past_fence(history) == []


def test_a_running_reaper_stops_when_the_recorded_number_of_shards_changes(
    services: Services, pg: psycopg.Connection[tuple[object, ...]], outbox: TableName, tmp_path: Path
) -> None:
    """The documented change of N records the new number and bumps every epoch: a reaper of the old
    number still running is fenced, finds the new number when it starts its next term, and exits
    with the one-line reason instead of harvesting."""
    group = unique("group")
    path = tmp_path / "reaper.yaml"
    path.write_text(
        f"harvest:\n  dataSource: {services.pg_dsn}\n  outboxTable: {outbox.qualified}\n"
        f"  leaderGroupID: {group}\n  shards: 2\n"
        f"  baseKafkaConfig:\n    bootstrap.servers: '{services.bootstrap}'\nhttp:\n  enabled: false\n",
        "utf-8",
    )
    reaper = subprocess.Popen(
        [sys.executable, "-m", "harvester.daemon.cli", "run", "-f", str(path)],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
        cwd=ROOT,
    )
    fence = fence_table(outbox)
    try:
        assert wait_until(
            lambda: (
                pg.execute(
                    sql.SQL("SELECT count(*) FROM {} WHERE outbox_table = %s").format(fence.ident), (outbox.qualified,)
                ).fetchone()
                == (2,)
            ),
            timeout=60,
        )
        pg.execute(
            sql.SQL("UPDATE {} SET shards = 4, epoch = epoch + 1 WHERE outbox_table = %s").format(fence.ident),
            (outbox.qualified,),
        )
        with psycopg.connect(services.pg_dsn) as conn:
            Stasher(outbox).stash(conn, [OutboxRecord(topic=unique("t"), key=f"k{i}", value="v") for i in range(20)])
        _, stderr = reaper.communicate(timeout=60)
    finally:
        if reaper.poll() is None:
            reaper.kill()
            reaper.communicate()
        delete_topics(services.bootstrap, [f"{group}.neli"])
    assert reaper.returncode == 1, stderr
    assert stderr.strip().splitlines()[-1] == (
        f"reaper: error: harvest.shards is 2 but {outbox.qualified} is harvested with 4 shards: every reaper "
        "of a group must use the same number (to change it, see docs/sharding.md)"
    )
    left = pg.execute(sql.SQL("SELECT count(*) FROM {} WHERE leader_id IS NULL").format(outbox.ident)).fetchone()
    assert left == (20,)  # fenced before it marked anything


def test_reaper_status_names_each_members_shards(
    services: Services, outbox: TableName, spawn: Spawn, group: str, tmp_path: Path
) -> None:
    members = [spawn("a", shards=SHARDS), spawn("b", shards=SHARDS)]
    assert wait_until(lambda: spread(members), timeout=90)
    path = tmp_path / "reaper.yaml"
    path.write_text(
        f"harvest:\n  dataSource: {services.pg_dsn}\n  outboxTable: {outbox.qualified}\n"
        f"  leaderGroupID: {group}\n  shards: {SHARDS}\n"
        f"  baseKafkaConfig:\n    bootstrap.servers: '{services.bootstrap}'\n",
        "utf-8",
    )
    found = subprocess.run(
        [sys.executable, "-m", "harvester.daemon.cli", "status", "-f", str(path), "--json"],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert found.returncode == 0, found.stdout + found.stderr
    doc = json.loads(found.stdout)
    assert doc["shards"] == SHARDS
    # (the processes' member names are the elector's defaults, host and pid)
    assert sorted(m["shards"] for m in doc["members"]) == sorted(sorted(leading(m)) for m in members)
    members[1].terminate()
    assert wait_until(lambda: leading(members[0]) == set(range(SHARDS)), timeout=60)
    text = subprocess.run(
        [sys.executable, "-m", "harvester.daemon.cli", "status", "-f", str(path)],
        capture_output=True,
        text=True,
        cwd=ROOT,
        timeout=60,
        check=False,
    )
    assert text.returncode == 0, text.stdout + text.stderr
    assert f"shards: {SHARDS}; every one led" in text.stdout
    assert f"shards {list(range(SHARDS))}" in text.stdout

"""``reaper status``: who leads a group and how its outbox is doing, without reaching any reaper.

Leadership is read where it is decided: the member of the leader group that holds partition 0 of
the leader topic leads (Kafka's admin API, describing the consumer group). The fence row in
PostgreSQL adds the term's leader id, epoch and start, written by the leader when its term began.
With ``shards`` > 1 the holder of partition ``i`` leads shard ``i``: each member lists its shards,
the fence row shown is the latest term of any shard, and every shard must have a leader.
The outbox itself gives the backlog (an exact count) and the oldest record's age, which is the lag
(the age of the oldest record committed and not acknowledged by Kafka) where a row leaves the table
once acknowledged; the leaders' heartbeats give the records in flight and, for the log source
without per-batch deletes (the table-less outbox, the retention window, Debezium's layout), the lag
their meter sampled. The dead-letter table gives the dead letters waiting. With the log source,
``pg_replication_slots`` gives the slot's lag and the WAL it retains.

The report, as text or JSON, is :mod:`.status_report`'s; :mod:`.status_kafka` reads the group and
the heartbeats, :mod:`.status_postgres` the outbox.
"""

from __future__ import annotations

import json

from harvester.daemon.errors import FailError
from harvester.daemon.settings import ReaperSettings
from harvester.daemon.status_kafka import leader_group
from harvester.daemon.status_postgres import outbox_state
from harvester.daemon.status_report import Status


def status(settings: ReaperSettings, timeout: float, *, as_json: bool) -> int:
    """Print the status; 0 when a member leads (every shard), 1 when nobody does (some shard has none).

    With several harvest sections, each outbox's status in file order (a JSON list with ``--json``);
    0 only when every outbox is led. An outbox whose table is missing is reported and the next one
    read; an unreachable service ends the command (exit 2), a group lookup that timed out or died
    too (exit 1)."""
    sections = settings.sections
    if len(sections) == 1:
        report, led = _report(settings, timeout)
        print(report.to_json() if as_json else report.to_text())
        return 0 if led else 1
    docs: list[object] = []
    all_led = True
    for i, section in enumerate(sections):
        try:
            report, led = _report(section, timeout)
        except FailError as exc:
            if exc.code != 1:
                raise
            all_led = False
            docs.append({"outbox_table": section.harvest.table.qualified, "error": str(exc)})
            if not as_json:
                print(f"{chr(10) if i else ''}outbox {section.harvest.table.qualified}: {exc}")
            continue
        all_led = all_led and led
        docs.append(json.loads(report.to_json()))
        if not as_json:
            print(f"{chr(10) if i else ''}{report.to_text()}")
    if as_json:
        print(json.dumps(docs, indent=2))
    return 0 if all_led else 1


def _report(settings: ReaperSettings, timeout: float) -> tuple[Status, bool]:
    """One outbox's status, and whether a member leads it (every shard of it)."""
    members, state, beats = leader_group(settings, timeout)
    leader = next((m.name for m in members if m.leads), None)
    shards = settings.harvest.shards
    every = {s for m in members for s in m.shards} >= set(range(shards))
    term, backlog, oldest, dead, slot = outbox_state(settings, timeout)
    # Only shards someone leads now: a gone leader's last heartbeat says nothing about the present.
    led = {s for m in members for s in m.shards}
    reported = [b.in_flight for shard, b in beats.items() if shard in led and b.in_flight is not None]
    lag: float | None = oldest or 0.0
    if settings.harvest.log_messages or settings.harvest.log_retention or settings.harvest.event_router:
        # The table, if any, keeps delivered rows (Debezium's layout: rows that stay, or none at all):
        # what is not done is in the leader's memory.
        lags = [b.lag_seconds for shard, b in beats.items() if shard in led and b.lag_seconds is not None]
        lag = max(lags) if lags else None
    report = Status(
        outbox_table=settings.harvest.table.qualified,
        group=settings.harvest.group_id,
        leader_topic=settings.harvest.topic,
        delivery=settings.harvest.delivery,
        group_state=state,
        members=members,
        leader=leader,
        term=term,
        heartbeat=beats.get(0),
        heartbeat_timeout_seconds=settings.harvest.limits.heartbeat_timeout.total_seconds(),
        backlog_records=backlog,
        oldest_record_age_seconds=oldest,
        in_flight_records=sum(reported) if reported else None,
        dead_letters=dead,
        shards=shards,
        slot=slot,
        lag_seconds=lag,
    )
    return report, leader is not None and every

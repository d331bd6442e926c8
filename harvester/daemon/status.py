"""``reaper status``: who leads a group and how its outbox is doing, without reaching any reaper.

Leadership is read where it is decided: the member of the leader group that holds partition 0 of
the leader topic leads (Kafka's admin API, describing the consumer group). The fence row in
PostgreSQL adds the term's leader id, epoch and start, written by the leader when its term began.
With ``shards`` > 1 the holder of partition ``i`` leads shard ``i``: each member lists its shards,
the fence row shown is the latest term of any shard, and every shard must have a leader.
The outbox itself gives the backlog (an exact count) and the oldest record's age, which is the lag
(the age of the oldest record committed and not acknowledged by Kafka) where a row leaves the table
once acknowledged; the leaders' heartbeats give the records in flight and, for the log source
without per-batch deletes (the table-less outbox, the retention window), the lag their meter
sampled. The dead-letter table gives the dead letters waiting. With the log source,
``pg_replication_slots`` gives the slot's lag and the WAL it retains.
"""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import time
from dataclasses import asdict, dataclass, field
from datetime import UTC, datetime
from multiprocessing.connection import Connection
from typing import Any, cast

from harvester.daemon.check import connect_pg, connection_cause, kafka_reason, pg_reason
from harvester.daemon.errors import FailError
from harvester.daemon.settings import ReaperSettings

# Answers a group describe can give while the coordinator is still being found or loaded; asked again.
_TRANSIENT = ("NOT_COORDINATOR", "COORDINATOR_NOT_AVAILABLE", "COORDINATOR_LOAD_IN_PROGRESS")
_CLIENT_PREFIX = "neli-"  # the elector's client.id is "neli-<instance name>"


@dataclass(frozen=True, slots=True)
class Member:
    """One reaper in the leader group."""

    name: str
    host: str
    member_id: str
    leads: bool
    shards: list[int] = field(default_factory=list)  # the shards (leader topic partitions) it holds


@dataclass(frozen=True, slots=True)
class Term:
    """The fence row: the latest leadership term that began."""

    leader_id: str | None
    epoch: int
    since: datetime


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The newest heartbeat on a partition of the leader topic: who sent it, for which term, how long
    ago, and the records its leader had in flight (None from a reaper that does not report them)."""

    member: str
    leader_id: str
    age_seconds: float  # by the sender's clock: the message's timestamp against this host's
    in_flight: int | None = None
    lag_seconds: float | None = None  # its leader's lag as its meter sampled it last


@dataclass(frozen=True, slots=True)
class Slot:
    """The log source's replication slot: how far it is behind and what it keeps in the log."""

    name: str
    lag_bytes: int  # WAL written after the slot's confirmed position
    retained_bytes: int  # WAL the server keeps for the slot (from its restart position)
    streaming: bool  # a reader (the leader's walsender) is attached


@dataclass(frozen=True, slots=True)
class Status:
    """What ``reaper status`` reports."""

    outbox_table: str
    group: str
    leader_topic: str
    delivery: str
    group_state: str
    members: list[Member]
    leader: str | None  # name of the member holding partition 0, None when nobody leads
    term: Term | None  # None when no reaper ever led over this outbox
    heartbeat: Heartbeat | None  # None when no heartbeat was ever sent
    heartbeat_timeout_seconds: float
    backlog_records: int
    oldest_record_age_seconds: float | None
    in_flight_records: int | None  # from the leaders' heartbeats: marks are kept in memory, not in the table
    dead_letters: int | None  # None without a dead-letter table
    shards: int = 1
    slot: Slot | None = None  # the log source's slot; None with mark-purge/reset, or when it is missing
    # The age of the oldest record committed and not acknowledged by Kafka; None when unknown (a log
    # source without per-batch deletes whose leaders' heartbeats do not report it).
    lag_seconds: float | None = None

    def to_json(self) -> str:
        doc = asdict(self)
        if self.term is not None:
            doc["term"]["since"] = self.term.since.isoformat()
        return json.dumps(doc, indent=2)

    def to_text(self) -> str:
        lines = [f"outbox {self.outbox_table}: delivery {self.delivery}; group {self.group}, topic {self.leader_topic}"]
        term = ""
        if self.term is not None:
            since = self.term.since.strftime("%Y-%m-%d %H:%M:%S %Z").strip()
            term = f"leader id {self.term.leader_id}, epoch {self.term.epoch}, since {since}"
        if self.leader is not None:
            lines.append(f"leader: {self.leader}" + (f"; {term}" if term else ""))
        else:
            lines.append(f"leader: none (no member holds partition 0 of {self.leader_topic})")
            if term:
                lines.append(f"last term: {term}")
        beat = self.heartbeat
        if beat is not None:
            lines.append(
                f"last heartbeat: {beat.age_seconds:.1f} s ago, from {beat.member}, leader id {beat.leader_id}"
            )
            if self.leader is not None and beat.age_seconds > self.heartbeat_timeout_seconds:
                lines.append(
                    f"warning: no heartbeat for more than harvest.limits.heartbeatTimeout "
                    f"({self.heartbeat_timeout_seconds:g} s): {self.leader} may have fenced itself "
                    "(or this host's clock is ahead of its)"
                )
        lines.append(f"members: {len(self.members)} (group {self.group_state.lower()})")
        if self.shards > 1:
            held = sorted(s for m in self.members for s in m.shards)
            unled = sorted(set(range(self.shards)) - set(held))
            lines.append(f"shards: {self.shards}" + (f"; without a leader: {unled}" if unled else "; every one led"))
            lines += [f"  {m.name}  host {m.host}  shards {m.shards}" for m in self.members]
        else:
            lines += [f"  {m.name}  host {m.host}{'  leads' if m.leads else ''}" for m in self.members]
        age = self.oldest_record_age_seconds
        lines.append(
            f"backlog: {self.backlog_records} record(s)" + (f", oldest {age:.1f} s old" if age is not None else "")
        )
        if self.lag_seconds is None:
            lines.append("lag: not reported (no leader's heartbeat carries it)")
        else:
            lines.append(f"lag: {self.lag_seconds:.1f} s (the oldest record committed and not acknowledged by Kafka)")
        if self.in_flight_records is None:
            lines.append("in flight: not reported (no leader's heartbeat carries it)")
        else:
            lines.append(f"in flight: {self.in_flight_records} record(s) marked, as the leaders' heartbeats report")
        if self.dead_letters is None:
            lines.append("dead letters: none (no dead-letter table)")
        else:
            lines.append(f"dead letters: {self.dead_letters} waiting")
        if self.slot is not None:
            slot = self.slot
            lines.append(
                f"log slot {slot.name}: lag {slot.lag_bytes} byte(s), retains {slot.retained_bytes} byte(s) of WAL, "
                + ("streaming to the leader" if slot.streaming else "no reader attached")
            )
        return "\n".join(lines)


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
    members, state, beats = _group(settings, timeout)
    leader = next((m.name for m in members if m.leads), None)
    shards = settings.harvest.shards
    every = {s for m in members for s in m.shards} >= set(range(shards))
    term, backlog, oldest, dead, slot = _database(settings, timeout)
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


_Group = tuple[list[Member], str, dict[int, Heartbeat]]


def _group(settings: ReaperSettings, timeout: float) -> _Group:
    """The leader group's members and state, as the group coordinator knows them, and the newest
    heartbeat of each shard; asked in a child process.

    librdkafka's group describe can abort the whole process when a request times out while the
    coordinator's broker restarts (``leader/members.py`` says more); ``reaper status`` is most wanted
    just then, so a child that dies that way, or answers nothing in time, is a lookup that failed,
    said in one line (exit 1: try again), as is a lookup that timed out.
    """
    group = settings.harvest.group_id
    context = multiprocessing.get_context("fork")  # the child needs the settings, not a re-import
    answers, answer = context.Pipe(duplex=False)
    child = context.Process(target=_group_in_child, args=(settings, timeout, answer), daemon=True)
    child.start()
    answer.close()
    got: tuple[bool, Any] | None = None
    backstop = timeout + 30  # the lookup has its own deadline; this is for a child that hangs
    try:
        if answers.poll(backstop):
            got = answers.recv()
    except EOFError:
        pass
    finally:
        answers.close()
        child.join(5)
        if child.is_alive():
            child.kill()
            child.join()
    if got is None:
        code = child.exitcode
        if code == -signal.SIGKILL:  # killed here, hung
            why = f"it did not answer within {backstop:g} s"
        elif code is not None and code < 0:
            why = f"it was killed by signal {-code} (librdkafka aborts so when a broker restarts mid-request)"
        else:
            why = f"exit code {code}"
        raise FailError(f"Kafka: the lookup of group {group} ended without an answer: {why}: try again", code=1)
    ok, result = got
    if not ok:
        message, code = result
        raise FailError(message, code=code)
    return cast(_Group, result)


def _group_in_child(settings: ReaperSettings, timeout: float, answer: Connection) -> None:
    """Answers (True, the group) or (False, (one line, exit code)); nothing escapes as a traceback."""
    try:
        answer.send((True, _lookup_group(settings, timeout)))
    except FailError as exc:
        answer.send((False, (str(exc), exc.code)))
    except Exception as exc:  # a client call this code did not expect to fail: still one line
        group = settings.harvest.group_id
        answer.send((False, (f"Kafka: the lookup of group {group} failed: {kafka_reason(exc)}", 1)))


def _lookup_group(settings: ReaperSettings, timeout: float) -> _Group:
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    harvest = settings.harvest
    servers = harvest.base_kafka_config.get("bootstrap.servers", "?")
    quiet = logging.getLogger("reaper.status.kafka")
    quiet.setLevel(logging.CRITICAL)  # librdkafka's retries would repeat what the one-line error says
    errors: list[KafkaError] = []  # what librdkafka says of its connections (error_cb)
    try:
        config: dict[str, Any] = {**harvest.base_kafka_config, "logger": quiet, "error_cb": errors.append}
        admin = AdminClient(config)
    except (KafkaException, TypeError, ValueError) as exc:
        raise FailError(f"harvest.baseKafkaConfig: {kafka_reason(exc)}") from None
    deadline = time.monotonic() + timeout
    while True:
        left = max(1.0, deadline - time.monotonic())
        try:
            described = admin.describe_consumer_groups([harvest.group_id], request_timeout=left)[harvest.group_id]
            group = described.result()
            break
        except KafkaException as exc:
            reason = kafka_reason(exc)
            if time.monotonic() < deadline and any(t in str(exc) for t in _TRANSIENT):
                time.sleep(0.2)
                continue
            admin.poll(0)  # serves the error callback
            cause = connection_cause(errors)
            err = exc.args[0] if exc.args else None
            if isinstance(err, KafkaError) and err.code() == KafkaError._TIMED_OUT and cause is None:
                # Connected, and no answer in time: a broker that restarts or is overloaded.
                raise FailError(
                    f"Kafka: the lookup of group {harvest.group_id} at {servers} timed out after {timeout:g} s"
                    " (a broker restarting or overloaded?): try again, or raise --timeout",
                    code=1,
                ) from None
            raise FailError(
                f"Kafka: cannot describe group {harvest.group_id} at {servers} (harvest.baseKafkaConfig): "
                + (cause or reason)
            ) from None
    members = []
    for m in group.members:
        partitions = m.assignment.topic_partitions if m.assignment is not None else []
        held = sorted(tp.partition for tp in partitions if tp.topic == harvest.topic and tp.partition < harvest.shards)
        leads = 0 in held
        name = m.client_id.removeprefix(_CLIENT_PREFIX)
        members.append(Member(name=name, host=m.host.lstrip("/"), member_id=m.member_id, leads=leads, shards=held))
    members.sort(key=lambda m: (not m.leads, m.name))
    return members, str(group.state.name), _last_heartbeats(settings, quiet, deadline)


def _last_heartbeats(settings: ReaperSettings, quiet: logging.Logger, deadline: float) -> dict[int, Heartbeat]:
    """The last message of each shard's partition of the leader topic, read without joining any group."""
    from confluent_kafka import Consumer, KafkaException, TopicPartition

    from leader.state import HEARTBEAT_FORMAT

    harvest = settings.harvest
    # A group id is required by the client, but assign() joins no group and nothing is committed.
    config = {**harvest.base_kafka_config, "group.id": f"{harvest.group_id}.status", "enable.auto.commit": False}
    consumer = Consumer({**config, "logger": quiet})
    beats: dict[int, Heartbeat] = {}
    try:
        last: list[TopicPartition] = []
        for shard in range(harvest.shards):
            partition = TopicPartition(harvest.topic, shard)
            try:
                low, high = consumer.get_watermark_offsets(partition, timeout=max(1.0, deadline - time.monotonic()))
            except KafkaException:
                return beats  # no leader topic yet: nobody ever led
            if high > low:
                last.append(TopicPartition(harvest.topic, shard, high - 1))
        consumer.assign(last)
        waiting = {tp.partition for tp in last}
        while waiting and time.monotonic() < deadline + 5:
            message = consumer.poll(0.5)
            got = message.partition() if message is not None and message.error() is None else None
            if message is None or got is None or got not in waiting:
                continue
            waiting.discard(got)
            try:
                doc = json.loads(message.value() or b"")
            except ValueError:
                continue
            if not isinstance(doc, dict) or doc.get("format") != HEARTBEAT_FORMAT:
                continue
            age = max(0.0, time.time() - message.timestamp()[1] / 1000)
            in_flight, lag = doc.get("in_flight"), doc.get("lag_seconds")
            beats[got] = Heartbeat(
                member=str(doc.get("member")),
                leader_id=str(doc.get("leader_id")),
                age_seconds=age,
                in_flight=in_flight if isinstance(in_flight, int) else None,
                lag_seconds=float(lag) if isinstance(lag, int | float) else None,
            )
        return beats
    finally:
        consumer.close()


def _database(
    settings: ReaperSettings, timeout: float
) -> tuple[Term | None, int, float | None, int | None, Slot | None]:
    """The fence row, the outbox's backlog and oldest age, the dead letters waiting, and the log
    source's slot."""
    import psycopg
    from psycopg import sql

    from harvester.postgres.schema.migrations import dead_letter_table, fence_table

    table = settings.harvest.table
    fence, dead = fence_table(table), dead_letter_table(table)
    with connect_pg(settings, timeout) as conn:
        try:
            found = conn.execute(
                "SELECT to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL, to_regclass(%s) IS NOT NULL",
                (table.quoted, fence.quoted, dead.quoted),
            ).fetchone()
            has_outbox, has_fence, has_dead = found if found else (False, False, False)
            tableless = settings.harvest.log_messages  # the backlog is in the slot's lag then
            # Debezium's layout: a table, but its rows say nothing of the backlog (deleted as they are
            # inserted, or kept as Debezium keeps them); the slot's lag does.
            rowless = tableless or settings.harvest.event_router is not None
            if not has_outbox and not tableless:
                raise FailError(
                    f"harvest.outboxTable: outbox table {table} does not exist (run 'reaper migrate')", code=1
                )
            term = None
            if has_fence:
                row = conn.execute(
                    # The latest term of any shard (the only one without shards).
                    sql.SQL(
                        "SELECT leader_id, epoch, acquired_at FROM {} WHERE outbox_table = %s"
                        " ORDER BY acquired_at DESC LIMIT 1"
                    ).format(fence.ident),
                    (table.qualified,),
                ).fetchone()
                if row is not None:
                    term = Term(
                        leader_id=str(row[0]) if row[0] else None, epoch=int(row[1]), since=row[2].astimezone(UTC)
                    )
            counts: Any = (0, None)
            if not rowless:
                counts = conn.execute(
                    sql.SQL(
                        "SELECT count(*),"
                        " extract(epoch FROM now() - (SELECT create_time FROM {t} ORDER BY id LIMIT 1))::float8"
                        " FROM {t}"
                    ).format(t=table.ident)
                ).fetchone()
                assert counts is not None  # an aggregate always returns a row
            dead_letters = None
            if has_dead:
                row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(dead.ident)).fetchone()
                dead_letters = int(row[0]) if row else 0
            slot = _slot(conn, settings.harvest.slot) if settings.harvest.source == "log" else None
        except psycopg.Error as exc:
            raise FailError(f"PostgreSQL: reading {table} failed: {pg_reason(exc)}", code=1) from None
    oldest = float(counts[1]) if counts[1] is not None else None
    return term, int(counts[0]), oldest, dead_letters, slot


def _slot(conn: Any, name: str) -> Slot | None:
    from harvester.postgres.log.logical import slot_state

    state = slot_state(conn, name)
    return None if state is None else Slot(name, *state)

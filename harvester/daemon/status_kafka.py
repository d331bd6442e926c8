"""``reaper status``'s reading of the leader group from Kafka: its members and the shards they hold
(the group coordinator's answer, asked in a child process) and the newest heartbeat of each shard
(the leader topic's last messages)."""

from __future__ import annotations

import json
import logging
import multiprocessing
import signal
import time
from multiprocessing.connection import Connection
from typing import Any, cast

from harvester.daemon.check import connection_cause, kafka_reason
from harvester.daemon.errors import FailError
from harvester.daemon.settings import ReaperSettings
from harvester.daemon.status_report import Heartbeat, Member

# Answers a group describe can give while the coordinator is still being found or loaded; asked again.
_TRANSIENT = ("NOT_COORDINATOR", "COORDINATOR_NOT_AVAILABLE", "COORDINATOR_LOAD_IN_PROGRESS")
_CLIENT_PREFIX = "neli-"  # the elector's client.id is "neli-<instance name>"

LeaderGroup = tuple[list[Member], str, dict[int, Heartbeat]]


def leader_group(settings: ReaperSettings, timeout: float) -> LeaderGroup:
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
    return cast(LeaderGroup, result)


def _group_in_child(settings: ReaperSettings, timeout: float, answer: Connection) -> None:
    """Answers (True, the group) or (False, (one line, exit code)); nothing escapes as a traceback."""
    try:
        answer.send((True, _lookup_group(settings, timeout)))
    except FailError as exc:
        answer.send((False, (str(exc), exc.code)))
    except Exception as exc:  # a client call this code did not expect to fail: still one line
        group = settings.harvest.group_id
        answer.send((False, (f"Kafka: the lookup of group {group} failed: {kafka_reason(exc)}", 1)))


def _lookup_group(settings: ReaperSettings, timeout: float) -> LeaderGroup:
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

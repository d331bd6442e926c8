"""What the configured PostgreSQL role and Kafka principal may do, as ``reaper check`` reports it: each
privilege or ACL that ``reaper run`` needs and lacks is one problem naming the grant that fixes it
(docs/security.md lists them all)."""

from __future__ import annotations

import logging
from typing import Any

from harvester.daemon.grants import needs
from harvester.daemon.settings import ReaperSettings
from harvester.postgres.schema.privileges import lacking

_GRANTS = "see 'reaper grants'"


def pg_problems(conn: Any, settings: ReaperSettings) -> list[str]:
    """The privileges ``reaper grants`` gives that the connected role lacks, on tables that exist."""
    harvest = settings.harvest
    role = conn.info.user
    problems = lacking(conn, harvest.table.schema or "public", needs(harvest), _GRANTS)
    if harvest.source == "log":
        row = conn.execute("SELECT rolreplication OR rolsuper FROM pg_roles WHERE rolname = current_user").fetchone()
        if row is not None and not row[0]:
            fix = f"ALTER ROLE {role} REPLICATION"
            problems.append(f"role {role} lacks REPLICATION for the log source: {fix} ({_GRANTS})")
    return problems


def kafka_problems(settings: ReaperSettings, timeout: float) -> list[str]:
    """The ACLs docs/security.md lists that the configured principal lacks on the leader topic, the
    leader group and (exactly-once) the checkpoint topic and its recovery group, as the brokers report its authorized
    operations. The output topics (named by the rows) and the transactional id (asking would fence the
    leader) are not checked here; ``reaper run`` names them when refused."""
    from confluent_kafka import KafkaException, TopicCollection
    from confluent_kafka.admin import AdminClient

    harvest = settings.harvest
    config = harvest.base_kafka_config
    user = f"User:{config['sasl.username']}" if "sasl.username" in config else "the principal"
    # librdkafka's own lines (a request timing out, events purged at close) would go raw to stderr,
    # among the reaper's JSON lines; what matters here is said as problems.
    quiet = logging.getLogger("reaper.access.kafka")
    quiet.setLevel(logging.CRITICAL)
    admin_config: dict[str, Any] = {**config, "logger": quiet}
    admin = AdminClient(admin_config)
    wanted = {harvest.topic: ("READ", "WRITE")}
    if harvest.delivery == "exactly_once":
        wanted[harvest.checkpoints] = ("READ", "WRITE")
    problems: list[str] = []
    for topic, operations in wanted.items():
        try:
            found = admin.describe_topics(TopicCollection([topic]), include_authorized_operations=True)[topic]
            operations_of = found.result(timeout).authorized_operations
        except KafkaException as exc:
            if exc.args[0].name() != "TOPIC_AUTHORIZATION_FAILED":
                continue  # absent (check says whether run creates it), or not known now: run finds out
            operations_of = []
        if operations_of is None:
            continue  # a broker that does not say
        allowed = {op.name for op in operations_of}
        lacking = [op for op in operations if op not in allowed]
        if lacking:
            problems.append(acl_problem(user, "topic", topic, lacking))
    groups = [harvest.group_id]
    if harvest.delivery == "exactly_once":  # the consumer a new leader reads the checkpoints with
        groups.append(f"{harvest.checkpoints}.recovery")
    for group in groups:
        try:
            described = admin.describe_consumer_groups([group], include_authorized_operations=True)[group]
            group_operations = described.result(timeout).authorized_operations
        except KafkaException as exc:
            if exc.args[0].name() != "GROUP_AUTHORIZATION_FAILED":
                continue  # a coordinator still loading, a timeout: not known now
            group_operations = []
        if group_operations is not None and "READ" not in {op.name for op in group_operations}:
            problems.append(acl_problem(user, "group", group, ["READ"]))
    return problems


def acl_problem(user: str, kind: str, name: str, operations: list[str]) -> str:
    """One line naming the ACL that fixes a refusal."""
    ops = " and ".join(operations)
    return f"Kafka ACL missing: {user} may not {ops} {kind} {name}: allow {ops} on {kind} {name} (docs/security.md)"

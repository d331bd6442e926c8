"""Reaching PostgreSQL and Kafka from the configuration, as ``reaper check`` does and as ``run`` and
``migrate`` do before their work: each failure is one line naming the setting to look at."""

from __future__ import annotations

import contextlib
import logging
import re
import tempfile
import time
from collections.abc import Iterator
from typing import TYPE_CHECKING, Any

from harvester.daemon import access
from harvester.daemon.errors import FailError, one_line
from harvester.daemon.settings import ReaperSettings, defaulted_connections
from harvester.postgres.connections import with_hint

if TYPE_CHECKING:
    from harvester.postgres.log.logical import LogSetup


def connect_pg(settings: ReaperSettings, timeout: float) -> Any:
    import psycopg

    try:
        return psycopg.connect(settings.harvest.data_source, autocommit=True, connect_timeout=max(1, round(timeout)))
    except psycopg.Error as exc:
        raise FailError(f"PostgreSQL: cannot connect (harvest.dataSource): {pg_reason(exc)}") from None


def lacking_at_start(settings: ReaperSettings, timeout: float) -> None:
    """Raise :class:`FailError` naming the first ACL or privilege ``reaper run`` lacks (a section whose
    database cannot be reached now is left to the harvester, which retries it)."""
    import psycopg

    problems = access.kafka_problems(settings, timeout)
    try:
        with connect_pg(settings, timeout) as conn:
            problems += access.pg_problems(conn, settings)
    except (FailError, psycopg.Error):
        pass
    if problems:
        more = f" (and {len(problems) - 1} more: 'reaper check' lists them)" if len(problems) > 1 else ""
        raise FailError(problems[0] + more)


def pg_reason(exc: BaseException) -> str:
    # libpq's message repeats the host and may quote parts of the DSN; keep its first line, redacted,
    # and name the connection setting that fixes a TLS or password refusal.
    text = str(exc).strip().splitlines()
    return with_hint(one_line(text[0] if text else type(exc).__name__))


# The leader election's names in its messages, as a reaper user knows them: the limits it is given, and
# its own settings that the reaper does not expose.
_ELECTION_TERMS = {
    "min_poll_interval": "minPollInterval",
    "max_poll_interval": "maxPollInterval",
    "group_heartbeat_interval": "the election's group heartbeat interval (1 s)",
    "heartbeat_interval": "the election's heartbeat interval (1 s)",
    "heartbeat_timeout": "heartbeatTimeout",
    "session_timeout": "the election's session timeout (10 s)",
}


def validate_election(settings: ReaperSettings) -> None:
    """Raise :class:`FailError` when the limits do not fit the leader election, in the settings' own
    names; ``run`` and ``check`` both call this, so they refuse the same files."""
    from pydantic import ValidationError

    from harvester.compose import elector_config

    try:
        elector_config(settings.harvest)
    except ValidationError as exc:
        message = str(exc.errors(include_url=False, include_input=False)[0]["msg"]).removeprefix("Value error, ")
        for term, name in _ELECTION_TERMS.items():
            message = re.sub(rf"\b{term}\b", name, message)
        raise FailError(f"harvest.limits: {message}") from None


def validate_spill_directory(settings: ReaperSettings) -> None:
    """Raise :class:`FailError` when the log source could not spill a large transaction where the
    settings say (``run`` and ``check`` both call this): found at start, not in the middle of a drain."""
    from harvester.postgres.log.spill import spill_directory

    harvest = settings.harvest
    if harvest.source != "log":
        return
    try:
        spill_directory(harvest.log_spill_directory)
    except ValueError as exc:
        raise FailError(f"harvest.logSpillDirectory: {exc}") from None


def check(settings: ReaperSettings, timeout: float) -> int:
    """Check every harvest section in file order; 0 when all is in place, 1 when something is missing."""
    from harvester.compose import raised_max_poll_interval

    sections = settings.sections
    several = len(sections) > 1
    for i, section in enumerate(sections):  # every configuration mistake before any connection
        with in_section(i if several else None):
            validate_kafka_config(section)
            validate_election(section)
            validate_spill_directory(section)
    problems: list[str] = []
    for i, section in enumerate(sections):
        if several:
            print(f"{chr(10) if i else ''}harvest[{i}]: outbox {section.harvest.table}")
        for default in defaulted_connections(section):
            print(f"note: {default} is not set: using the default")
        if (raised := raised_max_poll_interval(section.harvest)) is not None:
            configured = section.harvest.limits.max_poll_interval.total_seconds()
            print(
                f"note: harvest.limits.maxPollInterval ({configured:g}s) is below the election's session timeout: "
                f"using {raised:g}s (set 10s or more to silence this)"
            )
        with in_section(i if several else None):
            problems += _check_postgres(section, timeout) + _check_kafka(section, timeout)
    for problem in problems:
        print(f"problem: {problem}")
    print("configuration ok" if not problems else f"{len(problems)} problem(s) found")
    return 1 if problems else 0


@contextlib.contextmanager
def in_section(index: int | None) -> Iterator[None]:
    """Name section ``index`` of a list of harvest sections in a :class:`FailError` naming a harvest
    setting (``harvest.x`` becomes ``harvest[1].x``); ``None``: a single section, named as it was."""
    try:
        yield
    except FailError as exc:
        if index is None:
            raise
        raise FailError(str(exc).replace("harvest.", f"harvest[{index}]."), code=exc.code) from None


def _check_postgres(settings: ReaperSettings, timeout: float) -> list[str]:
    from harvester.postgres.schema import catalog, migrations, widen

    table = settings.harvest.table
    with connect_pg(settings, timeout) as conn:
        info = conn.info
        print(
            f"postgres: reachable; server {info.parameter_status('server_version')}, "
            f"host {info.host}:{info.port}, database {info.dbname}, user {info.user}"
        )
        if settings.harvest.log_messages:
            applied = migrations.applied(conn, table)
            print(
                f"table-less outbox {table} (messages with prefix {settings.harvest.prefix}):"
                f" no table needed; migrations applied: {', '.join(applied) or 'none'}"
            )
            return _check_log_source(conn, settings) + access.pg_problems(conn, settings)
        if settings.harvest.event_router is not None:  # layout debezium
            from harvester.postgres.log.event_router_layout import missing_columns

            unusable = missing_columns(conn, table, settings.harvest.event_router)
            columns_named = ", ".join(settings.harvest.event_router.columns)
            print(f"outbox table {table} (layout debezium): {'not usable' if unusable else 'present'}; {columns_named}")
            return unusable + _check_log_source(conn, settings) + access.pg_problems(conn, settings)
        try:
            columns = catalog.read(conn, table)
        except catalog.OutboxMissingError:
            print(f"outbox table {table}: absent")
            return [f"outbox table {table} does not exist: run 'reaper migrate'"]
        except catalog.UnsupportedOutboxError as exc:
            print(f"outbox table {table}: present, not usable")
            return [str(exc)]
        applied = migrations.applied(conn, table)
        print(
            f"outbox table {table}: present; kafka_key {columns.type_of('kafka_key')}, "
            f"kafka_value {columns.type_of('kafka_value')}; migrations applied: {', '.join(applied) or 'none'}"
        )
        problems: list[str] = []
        for derived in widen.narrower(conn, table):
            if derived.narrower is None:
                continue  # created by 'reaper migrate' or on first use, from the outbox's types
            fits = "narrower than the outbox" if derived.narrower else "holds the outbox's columns"
            print(f"{derived.label} {derived.table}: present, {fits}")
            problems += [str(column) for column in derived.narrower]
        return problems + _check_log_source(conn, settings) + access.pg_problems(conn, settings)


def _check_log_source(conn: Any, settings: ReaperSettings) -> list[str]:
    from harvester.postgres.log import logical

    harvest = settings.harvest
    if harvest.source != "log":
        return []
    problems = logical.missing(conn, harvest.log_setup)
    state = "ready" if not problems else "not ready"
    spills = harvest.log_spill_directory or tempfile.gettempdir()  # usable: validate_spill_directory said so
    print(f"log source: slot {harvest.slot}, publication {harvest.publication}: {state}; spill files in {spills}")
    if problems:  # what a failover does to the slot is for when it can be read
        return [f"log source: {p}" for p in problems]
    return _check_failover(conn, harvest.log_setup)


def _check_failover(conn: Any, setup: LogSetup) -> list[str]:
    """What a failover does to the slot: a line, and as problems a slot that could be a failover slot
    and is not (PostgreSQL 17+), and a table-less outbox whose records a failover would lose."""
    from harvester.postgres.log import logical

    state = logical.failover(conn, setup.slot)
    print(f"log source: failover: {state.describe()}")
    problems: list[str] = []
    if state.version >= logical.FAILOVER_SLOTS and not state.failover:
        problems.append(f"log source: {state.problem()}")
    risk = logical.failover_risk(conn, setup)
    if risk is not None:
        problems.append(f"log source: {risk}")
    elif setup.prefix is not None and not state.protected:
        print("log source: a failover loses the records not yet delivered (harvest.logAcceptLossOnFailover)")
    return problems


def _check_kafka(settings: ReaperSettings, timeout: float) -> list[str]:
    harvest = settings.harvest
    servers = harvest.base_kafka_config.get("bootstrap.servers", "?")
    metadata = reach_kafka(settings, timeout)
    print(f"kafka: reachable; {len(metadata.brokers)} broker(s) via {servers}, cluster {metadata.cluster_id}")
    problems = access.kafka_problems(settings, timeout)
    topic = metadata.topics.get(harvest.topic)
    shards = harvest.shards
    if topic is None and any(harvest.topic in p for p in problems):
        print(f"leader topic {harvest.topic}: not visible to this principal; group {harvest.group_id}")
        return problems
    if topic is None:
        # Not a problem: run's leader election creates its topic (one partition per shard) when absent.
        print(
            f"leader topic {harvest.topic}: absent; reaper run creates it ({shards} partition"
            f"{'s' if shards > 1 else ''}); group {harvest.group_id}"
        )
        return problems
    if topic.error is not None:
        print(f"leader topic {harvest.topic}: present, not usable")
        return [f"leader topic {harvest.topic} (harvest.leaderTopic): {topic.error.str()}", *problems]
    have = len(topic.partitions)
    print(f"leader topic {harvest.topic}: present, {have} partition(s); group {harvest.group_id}")
    if have < shards or (shards > 1 and have != shards):  # as run's election refuses it
        return [f"leader topic {harvest.topic} (harvest.leaderTopic): {have} partition(s), harvest.shards {shards}"]
    return problems


def reach_kafka(settings: ReaperSettings, timeout: float, *, say_waiting: bool = False) -> Any:
    """The cluster's metadata as the configuration reaches it within ``timeout`` (librdkafka retries
    the connection meanwhile), or :class:`FailError`: one line with the cause and the settings to look
    at. The cause is librdkafka's own (a refused connection, a SASL or SSL handshake that failed, from
    its error callback), not the generic "Broker transport failure" the request ends with; its log
    lines, which repeat that cause on every retry, are dropped. ``say_waiting``: log the cause once
    when the first attempt fails, with how much longer it is retried."""
    import structlog
    from confluent_kafka import KafkaError, KafkaException
    from confluent_kafka.admin import AdminClient

    quiet = logging.getLogger("reaper.kafka.reach")
    quiet.setLevel(logging.CRITICAL)
    errors: list[KafkaError] = []
    config: dict[str, Any] = {**settings.harvest.base_kafka_config, "logger": quiet, "error_cb": errors.append}
    servers = settings.harvest.base_kafka_config.get("bootstrap.servers", "?")
    admin = AdminClient(config)
    deadline = time.monotonic() + timeout
    while True:
        left = deadline - time.monotonic()
        try:
            return admin.list_topics(timeout=max(0.1, min(left, _KAFKA_ATTEMPT)))
        except KafkaException as exc:
            admin.poll(0)  # serves the error callback
            reason = connection_cause(errors) or kafka_reason(exc)
            if "certificate verify failed" in reason:
                reason = tls_diagnosis(settings.harvest.base_kafka_config) or reason
            where = _kafka_settings(reason)
            # A refused certificate or password stays refused: waiting out the start's bound helps nobody.
            refused = any(e.code() == KafkaError._AUTHENTICATION for e in errors) or "certif" in reason
            if left <= _KAFKA_ATTEMPT or refused:
                raise FailError(f"Kafka unreachable at {servers} ({where}): {reason}") from None
        if say_waiting:
            say_waiting = False
            structlog.get_logger("reaper").warning(
                "kafka_unreachable", servers=servers, error=reason, settings=where, retry_seconds=round(left)
            )


_KAFKA_ATTEMPT = 2.0
"""Seconds of one metadata request while waiting for Kafka."""


# "sasl_plaintext://host:9092/bootstrap: ... (after 1ms in state AUTH_HANDSHAKE)": the broker's name
# and librdkafka's timing around the cause.
_RDKAFKA_NOISE = re.compile(r"^\S+/(?:bootstrap|\d+): |\s*\(after \d+ms in state \w+[^)]*\)|[\s:]+$")


def connection_cause(errors: list[Any]) -> str | None:
    """The cause of a failed connection among what librdkafka's error callback gave (``KafkaError``
    values), without the broker's name and timing around it; None when it gave none (the brokers
    were reached, or not tried yet)."""
    from confluent_kafka import KafkaError

    causes = [e.str() for e in errors if e.code() != KafkaError._ALL_BROKERS_DOWN]
    return _RDKAFKA_NOISE.sub("", causes[0]) if causes else None


def tls_diagnosis(config: dict[str, Any]) -> str | None:
    """Why the first bootstrap server's certificate was refused, as Python's TLS says it (librdkafka
    says only that it could not be verified): a CA that did not sign it, or a host name not in it."""
    import socket
    import ssl

    server = str(config.get("bootstrap.servers", "")).split(",")[0].strip()
    host, _, port = server.rpartition(":")
    try:
        context = ssl.create_default_context(cafile=config.get("ssl.ca.location"))
        raw = socket.create_connection((host, int(port)), timeout=5)
        with raw, context.wrap_socket(raw, server_hostname=host):
            return None
    except ssl.SSLCertVerificationError as exc:
        if "mismatch" in str(exc.verify_message):  # Hostname mismatch, IP address mismatch
            return f"the broker's certificate does not name {host!r} (certificate verify failed: {exc.verify_message})"
        return f"the broker's certificate is not signed by a CA in ssl.ca.location ({exc.verify_message})"
    except (OSError, ValueError):
        return None


def _kafka_settings(reason: str) -> str:
    """The settings a Kafka connection failure points to."""
    if "does not name" in reason:
        return "harvest.baseKafkaConfig: bootstrap.servers, a name in the broker's certificate"
    if "not signed by" in reason or "certificate verify failed" in reason:
        return "harvest.baseKafkaConfig: ssl.ca.location, the CA that signed the broker's certificate"
    if "SASL" in reason:
        return "harvest.baseKafkaConfig: security.protocol, sasl.mechanism, sasl.username, sasl.password"
    if "SSL" in reason:
        return "harvest.baseKafkaConfig: security.protocol, ssl.*"
    return "harvest.baseKafkaConfig: bootstrap.servers"


def kafka_reason(exc: BaseException) -> str:
    err: Any = exc.args[0] if exc.args else None
    return str(err.str()) if hasattr(err, "str") else str(exc)


def validate_kafka_config(settings: ReaperSettings) -> None:
    """Build (and drop) a producer from the configured maps: librdkafka checks every property name
    and value when a client is created, so a typo is reported here, once, as a configuration error."""
    from confluent_kafka import KafkaException, Producer

    from harvester.kafka.publisher import producer_config

    harvest = settings.harvest
    quiet = logging.getLogger("reaper.kafka.validate")
    quiet.setLevel(logging.CRITICAL)
    try:
        Producer({**producer_config(harvest.base_kafka_config, harvest.producer_kafka_config), "logger": quiet})
    except KafkaException as exc:
        raise FailError(f"harvest.baseKafkaConfig/producerKafkaConfig: {kafka_reason(exc)}") from None
    except (TypeError, ValueError) as exc:
        raise FailError(f"harvest.baseKafkaConfig/producerKafkaConfig: {exc}") from None

"""The ``reaper`` command: run the harvester as a daemon, migrate the outbox, check the configuration.

Exit codes: 0 success; 1 a runtime failure, or ``check`` found something missing; 2 a configuration
mistake or an unreachable service (always one line on stderr, never a traceback); 128+N after a
second signal N (immediate exit).
"""

from __future__ import annotations

import argparse
import contextlib
import logging
import os
import signal
import sys
import threading
from collections.abc import Mapping, Sequence
from importlib.metadata import PackageNotFoundError, version
from types import FrameType
from typing import TYPE_CHECKING, Any

from harvester import dlq_cli, logs
from harvester.logs import REDACTOR
from harvester.settings import CONFIG_ENV, ReaperSettings, SettingsError, load, secret_values

if TYPE_CHECKING:
    from harvester.harvester import Harvester
    from harvester.http import HttpServer

COMMANDS = ("run", "migrate", "check", "dlq")

DESCRIPTION = """\
reaper drains a transactional outbox table in PostgreSQL into Kafka.

Applications INSERT records into the outbox table in the same transaction as their own changes;
reaper publishes them to Kafka in order per key and deletes them once Kafka acknowledged them.
Run several reapers against the same outbox: one leads (harvests), the others stand by and take
over within seconds when it stops or fails.

Typical first use:
  reaper check   -f reaper.yaml    # is the configuration valid, are PostgreSQL and Kafka reachable?
  reaper migrate -f reaper.yaml    # create the outbox table (and the optional trigger) if absent
  reaper run     -f reaper.yaml    # harvest until SIGTERM/SIGINT

A goharvest reaper.yaml works unchanged, and so does goharvest's command line: reaper -f reaper.yaml
"""

EPILOG = f"""\
configuration:
  -f/--file names a YAML file; without it, ${CONFIG_ENV} is used; without either, built-in defaults.
  Any setting can be overridden from the environment: REAPER_<SECTION>__<FIELD>, e.g.
    REAPER_HARVEST__DATA_SOURCE='host=db user=app dbname=app'
    REAPER_HARVEST__LIMITS__MAX_IN_FLIGHT_RECORDS=5000
    REAPER_HARVEST__BASE_KAFKA_CONFIG__SASL_PASSWORD=...   (Kafka property sasl.password)
  Any string may refer to a secret: ${{env:NAME}} or ${{file:/path/to/secret}}.

exit codes:
  0 ok; 1 runtime failure (or check found something missing); 2 configuration mistake or
  unreachable service; 128+N after a second signal N.

See docs/reaper.md for every setting, the metrics and the endpoints.
"""


def package_version() -> str:
    """The installed version of outbox-harvester."""
    try:
        return version("outbox-harvester")
    except PackageNotFoundError:
        return "unknown"


class _FailError(Exception):
    """Stop with a one-line message and an exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def _one_line(text: str) -> str:
    return " ".join(REDACTOR.text(str(text)).split())


def _parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="reaper",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-V", "--version", action="version", version=f"reaper (outbox-harvester) {package_version()}")
    common = argparse.ArgumentParser(add_help=False)
    common.add_argument(
        "-f",
        "--file",
        metavar="PATH",
        default=os.environ.get(CONFIG_ENV) or None,
        help=f"configuration file (reaper.yaml); default: ${CONFIG_ENV}, else built-in defaults",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    sub.add_parser(
        "run",
        parents=[common],
        help="harvest the outbox until SIGTERM/SIGINT (the daemon)",
        description="Compete for leadership and, while leader, publish outbox records to Kafka. Serves "
        "/metrics, /healthz and /readyz on the http port. SIGTERM or SIGINT stops gracefully (finish "
        "in-flight records, hand leadership over, exit 0); a second signal exits at once (nothing is "
        "lost: unacknowledged records stay in the outbox for the next leader).",
    )
    sub.add_parser(
        "migrate",
        parents=[common],
        help="create the outbox table and the optional objects other features need, if absent",
        description="Apply the bundled SQL migrations to the configured outbox table, idempotently: each is "
        "recorded in harvester_migrations and applied once. Existing tables and data are left as they are.",
    )
    check = sub.add_parser(
        "check",
        parents=[common],
        help="validate the configuration and reach PostgreSQL and Kafka; print what was found",
        description="Validate the configuration, connect to PostgreSQL and Kafka, and report the server "
        "version, the outbox table and its value column type, the broker count and the leader topic. "
        "Exit 0 when all is in place, 1 when the table or leader topic is missing, 2 on a configuration "
        "mistake or an unreachable service.",
    )
    check.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="bound on each connection attempt (default 5)"
    )
    dlq_cli.add_parser(sub, common)
    return parser


def main(argv: Sequence[str] | None = None) -> int:
    """Entry point of the ``reaper`` console script; returns the exit code."""
    args_list = list(sys.argv[1:] if argv is None else argv)
    # goharvest's reaper took only "-f FILE"; treat a command line without a command as "run".
    if args_list and args_list[0] not in COMMANDS and args_list[0] not in ("-h", "--help", "-V", "--version"):
        args_list.insert(0, "run")
    parser = _parser()
    if not args_list:
        parser.print_help(sys.stderr)
        return 2
    args = parser.parse_args(args_list)
    try:
        settings = load(args.file)
        logs.configure(
            settings.logging.level,
            settings.logging.format,
            instance=settings.harvest.name,
            secrets=secret_values(settings),
        )
        if args.command == "migrate":
            return _migrate(settings)
        if args.command == "check":
            return _check(settings, args.timeout)
        if args.command == "dlq":
            with _connect_pg(settings, 10) as conn:
                held = settings.harvest.dead_letter_policy == "hold_key"
                return dlq_cli.run(args, conn, settings.harvest.table, held_keys=held)
        return _run(settings)
    except SettingsError as exc:
        print(f"reaper: configuration error: {_one_line(str(exc))}", file=sys.stderr)
        return 2
    except _FailError as exc:
        print(f"reaper: error: {_one_line(str(exc))}", file=sys.stderr)
        return exc.code


# ---------------------------------------------------------------------------------------- migrate


def _connect_pg(settings: ReaperSettings, timeout: float) -> Any:
    import psycopg

    try:
        return psycopg.connect(settings.harvest.data_source, autocommit=True, connect_timeout=max(1, round(timeout)))
    except psycopg.Error as exc:
        raise _FailError(f"PostgreSQL: cannot connect (harvest.dataSource): {_pg_reason(exc)}") from None


def _pg_reason(exc: BaseException) -> str:
    # libpq's message repeats the host and may quote parts of the DSN; keep its first line, redacted.
    text = str(exc).strip().splitlines()
    return _one_line(text[0] if text else type(exc).__name__)


def _migrate(settings: ReaperSettings) -> int:
    import psycopg

    from harvester.migrations import migrate

    table = settings.harvest.table
    with _connect_pg(settings, 10) as conn:
        try:
            applied = migrate(conn, table)
        except psycopg.Error as exc:
            raise _FailError(f"migrating {table} failed: {_pg_reason(exc)}", code=1) from None
    if applied:
        print(f"outbox table {table}: applied {', '.join(applied)}")
    else:
        print(f"outbox table {table}: up to date")
    return 0


# ---------------------------------------------------------------------------------------- check


def _check(settings: ReaperSettings, timeout: float) -> int:
    _validate_kafka_config(settings)
    problems = _check_postgres(settings, timeout) + _check_kafka(settings, timeout)
    for problem in problems:
        print(f"problem: {problem}")
    print("configuration ok" if not problems else f"{len(problems)} problem(s) found")
    return 1 if problems else 0


def _check_postgres(settings: ReaperSettings, timeout: float) -> list[str]:
    from psycopg import sql

    from harvester.store import DESCRIBE_SQL

    harvest = settings.harvest
    table = harvest.table
    with _connect_pg(settings, timeout) as conn:
        info = conn.info
        print(
            f"postgres: reachable; server {info.parameter_status('server_version')}, "
            f"host {info.host}:{info.port}, database {info.dbname}, user {info.user}"
        )
        rows = conn.execute(DESCRIBE_SQL, (table.quoted,)).fetchall()
        if not rows:
            print(f"outbox table {table}: absent")
            return [f"outbox table {table} does not exist: run 'reaper migrate'"]
        types = {str(r[0]): str(r[1]) + (f"({r[2]})" if r[2] is not None else "") for r in rows}
        ledger = sql.Identifier(table.schema, "harvester_migrations") if table.schema else sql.Identifier(
            "harvester_migrations"
        )
        exists = conn.execute("SELECT to_regclass(%s)", (ledger.as_string(conn),)).fetchone()
        applied: list[str] = []
        if exists is not None and exists[0] is not None:
            applied = [
                str(r[0])
                for r in conn.execute(
                    sql.SQL("SELECT version FROM {} WHERE table_name = %s ORDER BY version").format(ledger),
                    (table.qualified,),
                )
            ]
        print(
            f"outbox table {table}: present; kafka_key {types.get('kafka_key', '?')}, "
            f"kafka_value {types.get('kafka_value', '?')}; migrations applied: {', '.join(applied) or 'none'}"
        )
    return []


def _check_kafka(settings: ReaperSettings, timeout: float) -> list[str]:
    from confluent_kafka import KafkaException
    from confluent_kafka.admin import AdminClient

    harvest = settings.harvest
    quiet = logging.getLogger("reaper.check.kafka")
    quiet.setLevel(logging.CRITICAL)  # librdkafka's retries would repeat what the one-line error says
    servers = harvest.base_kafka_config.get("bootstrap.servers", "?")
    try:
        config: dict[str, Any] = {**harvest.base_kafka_config, "logger": quiet}
        metadata = AdminClient(config).list_topics(timeout=timeout)
    except KafkaException as exc:
        raise _FailError(f"Kafka unreachable at {servers} (harvest.baseKafkaConfig): {_kafka_reason(exc)}") from None
    print(f"kafka: reachable; {len(metadata.brokers)} broker(s) via {servers}, cluster {metadata.cluster_id}")
    topic = metadata.topics.get(harvest.topic)
    if topic is None or topic.error is not None:
        print(f"leader topic {harvest.topic}: absent")
        return [
            f"leader topic {harvest.topic} does not exist: create it (1 partition) unless the brokers "
            "auto-create topics"
        ]
    print(f"leader topic {harvest.topic}: present, {len(topic.partitions)} partition(s); group {harvest.group_id}")
    return []


# ---------------------------------------------------------------------------------------- run


class _Signals:
    """First SIGTERM/SIGINT asks for a graceful stop; a second one exits at once."""

    def __init__(self) -> None:
        self.stop = threading.Event()
        self.received: int | None = None
        self._previous: dict[int, Any] = {}

    def install(self) -> None:
        for sig in (signal.SIGTERM, signal.SIGINT):
            self._previous[sig] = signal.signal(sig, self._handle)

    def restore(self) -> None:
        """Put back the handlers found by :meth:`install` (matters when ``main`` runs in-process)."""
        for sig, handler in self._previous.items():
            signal.signal(sig, handler)

    def _handle(self, signum: int, _frame: FrameType | None) -> None:
        if self.stop.is_set():
            # Nothing is lost: unacknowledged records stay marked in the outbox and the next leader
            # marks them again. os._exit skips the graceful path that is evidently stuck.
            os.write(2, f"reaper: second signal {signal.Signals(signum).name}: exiting now\n".encode())
            os._exit(128 + signum)
        self.received = signum
        self.stop.set()


class _HealthCache:
    """Readiness from ``Harvester.health()``, refreshed in the background so probes answer at once."""

    def __init__(self, harvester: Harvester, interval: float) -> None:
        self._harvester = harvester
        self._interval = interval
        self._lock = threading.Lock()
        self._latest: dict[str, Any] = {"database_ok": False, "kafka_ok": False, "is_leader": False, "running": False}
        self._closed = threading.Event()
        self._thread = threading.Thread(target=self._loop, name="reaper-health", daemon=True)

    def start(self) -> None:
        self._thread.start()

    def close(self) -> None:
        self._closed.set()

    def _loop(self) -> None:
        while True:
            try:
                latest = dict(self._harvester.health())
            except Exception as exc:  # a failing check means "not ready", never a dead thread
                latest = {"database_ok": False, "kafka_ok": False, "is_leader": False, "running": False,
                          "error": type(exc).__name__}
            with self._lock:
                self._latest = latest
            if self._closed.wait(self._interval):
                return

    def liveness(self) -> tuple[bool, Mapping[str, object]]:
        alive = self._harvester.alive
        return alive, {"threads_alive": alive}

    def readiness(self) -> tuple[bool, Mapping[str, object]]:
        with self._lock:
            latest = dict(self._latest)
        # A standby is ready too: it reaches both services and takes over at once when needed.
        ok = bool(latest.get("running") and latest.get("database_ok") and latest.get("kafka_ok"))
        return ok, {k: latest[k] for k in ("is_leader", "database_ok", "kafka_ok", "running") if k in latest}


def _run(settings: ReaperSettings) -> int:
    """Build the harvester and the HTTP endpoint, then serve until a signal."""
    from prometheus_client import CollectorRegistry, Gauge
    from pydantic import ValidationError

    from harvester.events import LeaderAcquired, LeaderFenced, LeaderRefreshed, LeaderRevoked
    from harvester.harvester import Harvester
    from harvester.http import HttpServer

    harvest = settings.harvest

    def on_event(event: object) -> None:
        if isinstance(event, LeaderAcquired | LeaderRefreshed):
            logs.set_leader(event.leader_id)
        elif isinstance(event, LeaderRevoked | LeaderFenced):
            logs.set_leader(None)

    _validate_kafka_config(settings)
    # librdkafka logs to stderr on its own unless given a logger: route it through ours, so its lines
    # are JSON too, carry the instance name, and are redacted.
    kafka = {**harvest.base_kafka_config, "logger": logging.getLogger("rdkafka")}
    harvest = harvest.model_copy(update={"base_kafka_config": kafka})
    registry = CollectorRegistry()
    info = Gauge("reaper_info", "Always 1; labels describe this reaper.", ["version", "instance"], registry=registry)
    info.labels(version=package_version(), instance=harvest.name).set(1)
    try:
        harvester = Harvester(harvest, on_event=on_event, registry=registry)
    except ValidationError as exc:  # combinations of limits the elector refuses
        first = exc.errors(include_url=False, include_input=False)[0]
        raise _FailError(f"harvest.limits: {str(first['msg']).removeprefix('Value error, ')}") from None
    health = _HealthCache(harvester, interval=5.0)
    server: HttpServer | None = None
    if settings.http.enabled:
        try:
            server = HttpServer(
                registry,
                host=settings.http.host,
                port=settings.http.port,
                liveness=health.liveness,
                readiness=health.readiness,
            )
        except OSError as exc:
            where = f"{settings.http.host}:{settings.http.port}"
            raise _FailError(f"http.port: cannot listen on {where}: {exc.strerror}") from None
        server.start()

    signals = _Signals()
    signals.install()
    try:
        return _serve(settings, harvester, health, server, signals)
    finally:
        signals.restore()


def _serve(
    settings: ReaperSettings, harvester: Harvester, health: _HealthCache, server: HttpServer | None, signals: _Signals
) -> int:
    """Start the harvester and run until a signal (or its unexpected end); return the exit code."""
    import structlog

    from harvester.store import OutboxMissingError, StoreError
    from leader.election import LeaderTopicError

    harvest = settings.harvest
    log = structlog.get_logger("reaper")
    try:
        harvester.start()
    except Exception as exc:
        _abandon(harvester, server)
        if isinstance(exc, OutboxMissingError):
            raise _FailError(f"harvest.outboxTable: {exc}") from None
        if isinstance(exc, StoreError):  # PostgreSQL unreachable, or a table of an unsupported layout
            raise _FailError(f"PostgreSQL (harvest.dataSource, harvest.outboxTable): {exc}") from None
        if isinstance(exc, LeaderTopicError):  # Kafka unreachable, or the topic absent and not creatable
            raise _FailError(f"harvest.leaderTopic: {exc}") from None
        log.debug("start_failed", exc_info=True)
        raise _FailError(f"cannot start: {type(exc).__name__}: {exc}", code=1) from None
    health.start()
    log.info(
        "reaper_started",
        version=package_version(),
        table=harvest.table.qualified,
        group=harvest.group_id,
        topic=harvest.topic,
        http_port=server.port if server else None,
    )
    while not signals.stop.wait(0.5):
        if harvester.wait(0):
            log.error("harvester_ended_unexpectedly")
            health.close()
            _close(server)
            return 1
    name = signal.Signals(signals.received).name if signals.received else "signal"
    timeout = settings.shutdown.timeout.total_seconds()
    log.info("reaper_stopping", signal=name, timeout_seconds=timeout, in_flight=harvester.in_flight_records)
    failed: list[BaseException] = []

    def stop() -> None:
        try:
            harvester.stop(timeout)
        except Exception as exc:  # reported below, as a log line rather than a raw thread traceback
            failed.append(exc)

    # stop() runs on its own thread so the main thread stays free to act on a second signal at once,
    # even while the stop blocks inside librdkafka.
    stopper = threading.Thread(target=stop, name="reaper-stop", daemon=True)
    stopper.start()
    while stopper.is_alive():
        stopper.join(0.2)
    health.close()
    _close(server)
    if failed:
        log.error("reaper_stop_failed", exc_info=failed[0])
        return 1
    log.info("reaper_stopped")
    return 0


def _close(server: HttpServer | None) -> None:
    if server is not None:
        server.close()


def _abandon(harvester: Harvester, server: HttpServer | None) -> None:
    """Best-effort cleanup after a failed start, so no background thread keeps the process alive."""
    _close(server)
    with contextlib.suppress(Exception):
        harvester.stop(1.0)


def _kafka_reason(exc: BaseException) -> str:
    err: Any = exc.args[0] if exc.args else None
    return str(err.str()) if hasattr(err, "str") else str(exc)


def _validate_kafka_config(settings: ReaperSettings) -> None:
    """Build (and drop) a producer from the configured maps: librdkafka checks every property name
    and value when a client is created, so a typo is reported here, once, as a configuration error."""
    from confluent_kafka import KafkaException, Producer

    from harvester.publisher import producer_config

    harvest = settings.harvest
    quiet = logging.getLogger("reaper.kafka.validate")
    quiet.setLevel(logging.CRITICAL)
    try:
        Producer({**producer_config(harvest.base_kafka_config, harvest.producer_kafka_config), "logger": quiet})
    except KafkaException as exc:
        raise _FailError(f"harvest.baseKafkaConfig/producerKafkaConfig: {_kafka_reason(exc)}") from None
    except (TypeError, ValueError) as exc:
        raise _FailError(f"harvest.baseKafkaConfig/producerKafkaConfig: {exc}") from None


if __name__ == "__main__":
    sys.exit(main())

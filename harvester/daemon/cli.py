"""The ``reaper`` command: run the harvester as a daemon, migrate the outbox, check the configuration.

Exit codes: 0 success; 1 a runtime failure, or ``check`` found something missing; 2 a configuration
mistake or an unreachable service (always one line on stderr, never a traceback); 128+N after a
second signal N (immediate exit).
"""

from __future__ import annotations

import argparse
import os
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import TYPE_CHECKING, Any

import harvester
from harvester.daemon import dlq, logs
from harvester.daemon.check import check, connect_pg, pg_reason
from harvester.daemon.environment import CONFIG_ENV
from harvester.daemon.errors import FailError, OneLineParser, one_line
from harvester.daemon.loading import load
from harvester.daemon.settings import ReaperSettings, SettingsError, secret_values

if TYPE_CHECKING:
    import psycopg

COMMANDS = ("run", "migrate", "check", "status", "dlq", "grants", "convert-debezium")

# The documentation's home: pyproject.toml's [project.urls] name the same pages. A wheel carries no
# docs/, so the help links there (tests/reaper/test_packaging.py maps each link onto a file of the repository).
DOCS = "https://github.com/outbox-harvester/outbox-harvester/blob/main/docs"

DESCRIPTION = f"""\
reaper drains a transactional outbox table in PostgreSQL into Kafka.

Applications INSERT records into the outbox table in the same transaction as their own changes;
reaper publishes them to Kafka in order per key and deletes them once Kafka acknowledged them.
Run several reapers against the same outbox: one leads (harvests), the others stand by and take
over within seconds when it stops or fails.

Typical first use:
  reaper check   -f reaper.yaml    # is the configuration valid, are PostgreSQL and Kafka reachable?
  reaper migrate -f reaper.yaml    # create the outbox table (and the optional trigger) if absent
  reaper run     -f reaper.yaml    # harvest until SIGTERM/SIGINT
  reaper status  -f reaper.yaml    # who leads, the group's members, backlog, in flight, dead letters
  reaper grants  -f reaper.yaml    # the SQL giving the runtime role only what it needs
  reaper convert-debezium connector.json > reaper.yaml   # from Debezium's outbox router

goharvest's command line works: reaper -f reaper.yaml; so does its reaper.yaml, but for a leader topic
that is one of Kafka's internal topics. Every difference:
  {DOCS}/reaper.md#differences-from-goharvest
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
  0 ok; 1 runtime failure (or check found something missing, or status found nobody leading);
  2 configuration mistake or unreachable service; 128+N after a second signal N.

documentation:
  every setting, the metrics and the endpoints: {DOCS}/reaper.md
  the runtime role's grants and the Kafka ACLs: {DOCS}/security.md
  the outbox table, for applications in any language: {DOCS}/writers.md
"""


def package_version() -> str:
    """The version of outbox-harvester: ``harvester.__version__``, which is also the distribution's version."""
    return harvester.__version__


def _parser() -> argparse.ArgumentParser:
    parser = OneLineParser(
        prog="reaper",
        description=DESCRIPTION,
        epilog=EPILOG,
        formatter_class=argparse.RawDescriptionHelpFormatter,
    )
    parser.add_argument("-V", "--version", action="version", version=f"reaper (outbox-harvester) {package_version()}")
    common = OneLineParser(add_help=False)
    common.add_argument(
        "-f",
        "--file",
        metavar="PATH",
        default=os.environ.get(CONFIG_ENV) or None,
        help=f"configuration file (reaper.yaml); default: ${CONFIG_ENV}, else built-in defaults",
    )
    sub = parser.add_subparsers(dest="command", metavar="COMMAND")
    run = sub.add_parser(
        "run",
        parents=[common],
        help="harvest the outbox until SIGTERM/SIGINT (the daemon)",
        description="Compete for leadership and, while leader, publish outbox records to Kafka. Serves "
        "/metrics, /healthz and /readyz on the http port. SIGTERM or SIGINT stops gracefully (finish "
        "in-flight records, hand leadership over, exit 0); a second signal exits at once (nothing is "
        "lost: unacknowledged records stay in the outbox for the next leader).",
    )
    run.add_argument(
        "--workers",
        type=_workers,
        metavar="N",
        help="run N reaper processes under this one, each leading some of the shards on a core of its own "
        "(default: the file's workers, else 1: one process)",
    )
    run.add_argument("--worker", help=argparse.SUPPRESS)  # set by the supervisor for its workers
    sub.add_parser(
        "migrate",
        parents=[common],
        help="create the outbox table and the optional objects other features need, if absent",
        description="Apply the bundled SQL migrations to the configured outbox table, idempotently: each is "
        "recorded in harvester_migrations and applied once. An existing outbox table keeps its column types "
        "and rows; the tables holding copies of its rows (dead letters, the Spark sink's staging) are widened "
        "to its column types when narrower. A schema named in harvest.outboxTable that does not exist is "
        "created (and reported); with source: log, the publication and the replication slot are created "
        "when absent. A table-less outbox (logMessages) or layout: debezium has no table of the reaper's: "
        "the application's table is left as it is, and only the fence and dead-letter tables, the "
        "publication and the slot are made.",
    )
    check = sub.add_parser(
        "check",
        parents=[common],
        help="validate the configuration and reach PostgreSQL and Kafka; print what was found",
        description="Validate the configuration, connect to PostgreSQL and Kafka, and report the server "
        "version, the outbox table and its value column type, the broker count and the leader topic (an "
        "absent leader topic is fine: reaper run creates it). Exit 0 when all is in place, 1 when the "
        "outbox table is missing or something found is unusable, 2 on a configuration mistake or an "
        "unreachable service.",
    )
    check.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="bound on each connection attempt (default 5)"
    )
    state = sub.add_parser(
        "status",
        parents=[common],
        help="who leads, the group's members, the backlog, records in flight and dead letters",
        description="Ask Kafka which member of the leader group holds partition 0 of the leader topic (it "
        "leads) and PostgreSQL for the fence row (leader id, epoch, since when), the outbox's backlog and "
        "oldest record, the records in flight (marked by a leader) and the dead letters waiting; the newest "
        "heartbeat on the leader topic tells which member sent it and how long ago. No reaper "
        "needs to be reachable. Exit 0 when a member leads, 1 when nobody does (or the outbox table is "
        "missing), 2 on a configuration mistake or an unreachable service.",
    )
    state.add_argument("--json", action="store_true", help="print one JSON document instead of text")
    state.add_argument(
        "--timeout", type=float, default=5.0, metavar="SECONDS", help="bound on each connection attempt (default 5)"
    )
    grant = sub.add_parser(
        "grants",
        parents=[common],
        help="print the SQL that gives the runtime role what reaper run needs, and nothing more",
        description="Print, without connecting, the SQL that creates the runtime role (when absent) and grants it\n"
        "what reaper run needs on the configured outbox for its source and delivery mode: apply it as the\n"
        "schema's owner after 'reaper migrate'.",
        epilog=f"The roles, the grants and the Kafka ACLs: {DOCS}/security.md",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the link unbroken
    )
    grant.add_argument(
        "--role", metavar="NAME", help="the runtime role (default: the user of harvest.dataSource, else 'reaper')"
    )
    grant.add_argument(
        "--spark-sink",
        action="store_true",
        help="the grants of a role that writes into the outbox through Spark's format('outbox') instead",
    )
    dlq.add_parser(sub, common)
    convert = sub.add_parser(
        "convert-debezium",
        help="print the reaper.yaml that reads what a Debezium outbox connector reads",
        description="Read a Debezium PostgreSQL connector's JSON configuration (as its REST API takes it)\n"
        "with an EventRouter transform and print a reaper.yaml with layout: debezium, the transform's\n"
        "options under eventRouter, unchanged. Exit 2 with one line naming an option that has no\n"
        "counterpart.",
        epilog=f"How to hand a running outbox over: {DOCS}/migrating.md#from-debeziums-outbox-router",
        formatter_class=argparse.RawDescriptionHelpFormatter,  # the link unbroken
    )
    convert.add_argument("connector", metavar="CONNECTOR.json", help="the connector's JSON file ('-': stdin)")
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
    if args.command == "convert-debezium":
        return _convert_debezium(args.connector)
    try:
        settings = load(args.file)
        port_file = None
        if args.command == "run" and args.worker:
            from harvester.daemon.workers import as_worker

            settings, port_file = as_worker(settings, args.worker)
        logs.configure(
            settings.logging.level,
            settings.logging.format,
            instance=settings.harvest.name,
            secrets=secret_values(settings),
        )
        if args.command == "migrate":
            return max(_migrate(section) for section in settings.sections)
        if args.command == "check":
            return check(settings, args.timeout)
        if args.command == "status":
            from harvester.daemon.status import status

            return status(settings, args.timeout, as_json=args.json)
        if args.command == "grants":
            return _grants(settings, args.role, args.spark_sink)
        if args.command == "dlq":
            section = dlq.section(settings, args.outbox)
            with connect_pg(section, 10) as conn:
                held = section.harvest.dead_letter_policy == "hold_key"
                routed = section.harvest.event_router is not None
                table, prefix = section.harvest.table, section.harvest.prefix
                return dlq.run(args, conn, table, held_keys=held, prefix=prefix, routed=routed)
        from harvester.daemon import workers
        from harvester.daemon.run import run

        if port_file is not None:
            return run(settings, package_version(), workers.announce_to(port_file))
        count = args.workers or settings.workers
        if count > 1:
            return workers.supervise(settings, args.file, count)
        return run(settings, package_version())
    except SettingsError as exc:
        print(f"reaper: configuration error: {one_line(str(exc))}", file=sys.stderr)
        return 2
    except FailError as exc:
        print(f"reaper: error: {one_line(str(exc))}", file=sys.stderr)
        return exc.code


def _grants(settings: ReaperSettings, role: str | None, spark_sink: bool) -> int:
    from psycopg.conninfo import conninfo_to_dict

    from harvester.daemon.grants import grants, role_error, spark_sink_grants

    if role is None:
        role = str(conninfo_to_dict(settings.harvest.data_source).get("user") or "reaper")
    problem = role_error(role)
    if problem is not None:
        raise FailError(f"--role: {problem}")
    if spark_sink:
        print("\n".join(spark_sink_grants(section.harvest.table, role) for section in settings.sections), end="")
    else:
        print("\n".join(grants(section.harvest, role) for section in settings.sections), end="")
    return 0


def _convert_debezium(path: str) -> int:
    from harvester.event_router import EventRouterError, converted_yaml

    try:
        text = sys.stdin.read() if path == "-" else Path(path).read_text(encoding="utf-8")
        print(converted_yaml(text), end="")
    except (OSError, EventRouterError) as exc:
        print(f"reaper: convert-debezium: {one_line(str(exc))}", file=sys.stderr)
        return 2
    return 0


def _workers(value: str) -> int:
    try:
        count = int(value)
    except ValueError:
        count = 0
    if not 1 <= count <= 64:
        raise argparse.ArgumentTypeError(f"{value!r} is not a number from 1 to 64")
    return count


def _migrate(settings: ReaperSettings) -> int:
    import psycopg

    from harvester.postgres.schema.migrations import ensure_shard_index, migrate
    from harvester.postgres.schema.sharding import shard_index
    from harvester.postgres.schema.widen import widen

    table, shards = settings.harvest.table, settings.harvest.shards
    if settings.harvest.log_messages or settings.harvest.layout == "debezium":
        return _migrate_tableless(settings)
    with connect_pg(settings, 10) as conn:
        try:
            # migrate() creates a missing schema silently; look first, so the output can say so.
            new_schema = table.schema is not None and not _schema_exists(conn, table.schema)
            applied = migrate(conn, table)
            indexed = ensure_shard_index(conn, table, shards)
            created = _log_source(conn, settings)
            widened, left = widen(conn, table)
        except psycopg.Error as exc:
            raise FailError(f"migrating {table} failed: {pg_reason(exc)}", code=1) from None
    if new_schema:
        print(f"schema {table.schema}: created")
    if applied:
        print(f"outbox table {table}: applied {', '.join(applied)}")
    for column in widened:
        print(f"{column.table}.{column.column}: widened from {column.current} to {column.wanted}")
    for column in left:
        print(f"problem: {column}")
    if not (applied or widened or left):
        print(f"outbox table {table}: up to date")
    if indexed:
        print(f"outbox table {table}: created index {shard_index(table, shards).name} for {shards} shards")
    for name in created:
        print(f"log source: created {name}")
    return 1 if left else 0


def _migrate_tableless(settings: ReaperSettings) -> int:
    """A table-less outbox, or a table of Debezium's layout (the application's, left as it is): the
    fence and dead-letter tables, the publication and the slot."""
    import psycopg

    from harvester.postgres.schema.migrations import ensure

    table = settings.harvest.table
    with connect_pg(settings, 10) as conn:
        try:
            applied = ensure(conn, table, "fence") + ensure(conn, table, "dead_letter", value_type="BYTEA")
            created = _log_source(conn, settings)
        except psycopg.Error as exc:
            raise FailError(f"migrating {table} failed: {pg_reason(exc)}", code=1) from None
    what = "outbox table (layout debezium)" if settings.harvest.layout == "debezium" else "table-less outbox"
    print(f"{what} {table}: " + (f"applied {', '.join(applied)}" if applied else "up to date"))
    for name in created:
        print(f"log source: created {name}")
    return 0


def _log_source(conn: psycopg.Connection[Any], settings: ReaperSettings) -> list[str]:
    """With ``source: log``, create the publication and the slot (after saying what the server lacks)."""
    from harvester.postgres.log import logical

    harvest = settings.harvest
    if harvest.source != "log":
        return []
    setup = harvest.log_setup
    blocking = [p for p in logical.missing(conn, setup) if "reaper migrate" not in p]
    if blocking:
        raise FailError(f"log source: {blocking[0]}", code=1)
    return logical.create(conn, setup)


def _schema_exists(conn: psycopg.Connection[Any], schema: str) -> bool:
    row = conn.execute("SELECT EXISTS (SELECT FROM pg_namespace WHERE nspname = %s)", (schema,)).fetchone()
    return bool(row and row[0])


if __name__ == "__main__":
    sys.exit(main())

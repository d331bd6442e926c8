"""``reaper dlq``: look at, replay and purge dead letters from the command line."""

from __future__ import annotations

import argparse
import json
import sys
from datetime import UTC, datetime
from typing import Any

import psycopg

from harvester.daemon.errors import FailError, OneLineParser
from harvester.daemon.settings import ReaperSettings
from harvester.postgres.schema import deadletter
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table


def add_parser(sub: Any, common: argparse.ArgumentParser) -> None:
    """Register ``dlq`` and its subcommands on the ``reaper`` parser."""
    dlq = sub.add_parser(
        "dlq",
        help="list, show, replay or purge dead-lettered records",
        description="Records that failed permanently harvest.limits.maxAttempts times are moved to the "
        "dead-letter table <outbox>_dead_letter (created by 'reaper migrate' or by the first dead letter). "
        "Replay moves them back into the outbox (new ids, original order); purge deletes old ones. Replay "
        "and purge ask for confirmation unless --yes is given. Every action exits 1 when the dead-letter "
        "table does not exist.",
    )
    actions = dlq.add_subparsers(dest="dlq_command", metavar="ACTION", required=True)
    chosen = OneLineParser(add_help=False, parents=[common])
    chosen.add_argument(
        "--outbox",
        metavar="TABLE",
        help="the harvest section whose dead letters to act on, by its outboxTable (required when the "
        "file lists several)",
    )
    common = chosen
    listing = actions.add_parser(
        "list",
        parents=[common],
        help="the oldest dead letters, one line each (no values)",
        description="Print the oldest dead letters of the outbox table (harvest.outboxTable) in id order, one "
        "line each: outbox id, when it was dead-lettered, attempts, reason, topic and key. Values are left "
        "out; 'reaper dlq show ID' prints one in full.",
    )
    listing.add_argument("-n", "--limit", type=_count, default=100, help="how many, at least 1 (default 100)")
    show = actions.add_parser(
        "show",
        parents=[common],
        help="one dead letter in full, as JSON",
        description="Print one dead letter as JSON: its content (value, headers), the reason and last error, "
        "the attempts and when they failed. Binary values are printed in hex. Exit 1 when there is no dead "
        "letter with that id.",
    )
    show.add_argument("id", type=int, help="outbox id of the record")
    replay = actions.add_parser(
        "replay",
        parents=[common],
        help="move dead letters back into the outbox, to be published again",
        description="Move the given dead letters (or all, with --all) back into the outbox table with new ids, "
        "in their original order, so that the leader publishes them again. With harvest.deadLetterPolicy "
        "hold_key, the records that waited behind a replayed key move behind it, keeping the key's order. "
        "When one of the ids is not a dead letter nothing is replayed (exit 1).",
    )
    replay.add_argument("ids", type=int, nargs="*", metavar="ID", help="outbox ids to replay")
    replay.add_argument("--all", action="store_true", help="replay every dead letter")
    replay.add_argument("--yes", action="store_true", help="do not ask for confirmation")
    purge = actions.add_parser(
        "purge",
        parents=[common],
        help="delete dead letters dead-lettered before a date",
        description="Delete, for good, the dead letters that were dead-lettered before the given date or timestamp.",
    )
    purge.add_argument("--before", required=True, type=_date, help="ISO date or timestamp (UTC if no zone)")
    purge.add_argument("--yes", action="store_true", help="do not ask for confirmation")


def section(settings: ReaperSettings, outbox: str | None) -> ReaperSettings:
    """The harvest section ``--outbox`` names (a table as written in ``outboxTable``, or qualified);
    raise :class:`FailError` when it names none, or is missing while the file lists several."""
    sections = settings.sections
    tables = ", ".join(s.harvest.table.qualified for s in sections)
    if outbox is None:
        if len(sections) > 1:
            raise FailError(f"--outbox: the configuration lists several outboxes ({tables}); choose one")
        return settings
    for candidate in sections:
        table = candidate.harvest
        if outbox in (table.outbox_table, table.table.qualified):
            return candidate
    raise FailError(f"--outbox: {outbox} is not an outboxTable of the configuration ({tables})")


def _count(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a whole number: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, not {value}")
    return value


def _date(text: str) -> datetime:
    try:
        value = datetime.fromisoformat(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an ISO date or timestamp: {text!r}") from None
    return value if value.tzinfo else value.replace(tzinfo=UTC)


def _confirm(question: str, yes: bool) -> bool:
    if yes:
        return True
    if not sys.stdin.isatty():
        print(f"{question} -- refusing without a terminal; pass --yes to confirm", file=sys.stderr)
        return False
    return input(f"{question} [y/N] ").strip().lower() in ("y", "yes")


_NOTHING_TO = {
    "list": "nothing to list",
    "show": "nothing to show",
    "replay": "nothing replayed",
    "purge": "nothing purged",
}


def _require_tables(conn: psycopg.Connection[Any], table: TableName, action: str, tableless: bool) -> None:
    """Raise :class:`FailError` (exit 1) when the outbox (unless table-less) or its dead-letter
    table does not exist: an empty answer would pretend there were no dead letters to look at."""
    outbox, dead_letters = deadletter.tables_exist(conn, table)
    if not outbox and not tableless:
        raise FailError(f"harvest.outboxTable: outbox table {table} does not exist (run 'reaper migrate')", code=1)
    if not dead_letters:
        raise FailError(
            f"dead-letter table {dead_letter_table(table)} does not exist (no record was ever dead-lettered, "
            f"and 'reaper migrate' was not run); {_NOTHING_TO[action]}",
            code=1,
        )


def run(
    args: argparse.Namespace,
    conn: psycopg.Connection[Any],
    table: TableName,
    *,
    held_keys: bool,
    prefix: str | None,
    routed: bool = False,
) -> int:
    """Carry out one ``dlq`` action; return the exit code. ``prefix``: a table-less outbox's, whose
    dead letters are replayed as logical messages. ``routed``: the outbox is Debezium's layout, whose
    records are made of rows by EventRouter's routing, so a record cannot be written back as a row."""
    if args.dlq_command == "replay" and bool(args.ids) == args.all:
        print("reaper dlq replay: error: give record ids or --all (not both)", file=sys.stderr)
        return 2
    if args.dlq_command == "replay" and routed:
        raise FailError(
            f"{table} is Debezium's layout (layout: debezium): a dead letter keeps the record's topic, not"
            " the route.by.field value it was routed from, so it cannot be written back as a row;"
            " the application inserts the event again, and 'reaper dlq purge' drops the dead letter",
            code=2,
        )
    _require_tables(conn, table, args.dlq_command, prefix is not None)
    if args.dlq_command == "list":
        rows = deadletter.list_dead_letters(conn, table, args.limit)
        for r in rows:
            print(
                f"{r['id']:>10}  {r['dead_lettered_at']:%Y-%m-%d %H:%M:%S}  attempts={r['attempts']}"
                f"  reason={r['reason']}  topic={r['kafka_topic']}  key={r['kafka_key']}"
            )
        print(f"{len(rows)} dead letter(s) in {dead_letter_table(table)}")
        return 0
    if args.dlq_command == "show":
        row = deadletter.show(conn, table, args.id)
        if row is None:
            raise FailError(f"no dead letter with id {args.id} in {dead_letter_table(table)}", code=1)
        print(json.dumps(row, default=_json, indent=2))
        return 0
    if args.dlq_command == "replay":
        if args.ids:
            missing = deadletter.missing_ids(conn, table, args.ids)
            if missing:
                listed = ", ".join(map(str, missing))
                where = dead_letter_table(table)
                raise FailError(f"no dead letter with id(s) {listed} in {where}; nothing replayed", code=1)
        what = "every dead letter" if args.all else f"{len(set(args.ids))} dead letter(s)"
        if not _confirm(f"replay {what} into {table}?", args.yes):
            return 1
        with conn.transaction():
            chosen = None if args.all else args.ids
            if prefix is not None:
                new_ids = deadletter.replay_messages(conn, table, chosen, prefix)
            else:
                new_ids = deadletter.replay(conn, table, chosen, held_keys=held_keys)
        print(f"replayed {len(new_ids)} record(s) into {table}" + (f" as ids {new_ids}" if new_ids else ""))
        return 0
    if not _confirm(f"delete dead letters of {table} dead-lettered before {args.before.isoformat()}?", args.yes):
        return 1
    with conn.transaction():
        count = deadletter.purge(conn, table, args.before)
    print(f"purged {count} dead letter(s) from {dead_letter_table(table)}")
    return 0


def _json(value: object) -> str:
    if isinstance(value, datetime):
        return value.isoformat()
    if isinstance(value, bytes | memoryview):
        return bytes(value).hex()
    return str(value)

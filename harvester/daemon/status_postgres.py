"""``reaper status``'s reading of the outbox from PostgreSQL: the fence row's latest term, the
backlog and its oldest record's age, the dead letters waiting, and the log source's slot."""

from __future__ import annotations

from datetime import UTC
from typing import Any

from harvester.daemon.check import connect_pg, pg_reason
from harvester.daemon.errors import FailError
from harvester.daemon.settings import ReaperSettings
from harvester.daemon.status_report import Slot, Term


def outbox_state(
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

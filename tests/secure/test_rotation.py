"""Rotating the runtime role's PostgreSQL password and the principal's SCRAM password, as
docs/security.md says: the reaper reads the PostgreSQL password from a libpq password file
(``passfile``), which libpq reads again at every connection, so a running reaper reconnects with the
new password; the Kafka password from a ``${file:...}`` reference, read at start, so its established
connections carry on and a restart takes the new one. Nothing is lost."""

from __future__ import annotations

from collections import Counter
from pathlib import Path

import psycopg
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)
from psycopg import sql

from tests.secure import services as s
from tests.secure.test_drain import acls, drained
from tests.support.kafka import read_messages, text

NEW_PASSWORD = "rt-rotated-pw"  # looked for in every log line too


def pgpass(path: Path, password: str) -> None:
    """Replaced whole (libpq may read it meanwhile), of mode 0600 (libpq ignores one others may read)."""
    new = path.with_suffix(".new")
    new.write_text(f"*:*:*:*:{password}\n")
    new.chmod(0o600)
    new.replace(path)


def test_rotated_passwords_are_taken_without_losing_records(secure: None, tmp_path: Path) -> None:
    box = s.outbox(tmp_path, {})
    group = f"outbox-harvester.{box.table}"
    topic = f"out_{box.schema}"
    s.create_topics([topic, f"{group}.neli"])
    user = s.principal(acls(group, topic, exactly_once=False))
    passfile, kafka_secret = tmp_path / "pgpass", tmp_path / "kafka-password"
    pgpass(passfile, s.PASSWORD)
    kafka_secret.write_text(s.PASSWORD + "\n")
    dsn = s.pg_dsn(box.runtime, s.PASSWORD).replace(f"password={s.PASSWORD}", f"passfile={passfile}")
    kafka = {**s.kafka_config(user, s.PASSWORD), "sasl.password": f"${{file:{kafka_secret}}}"}
    config = s.write(tmp_path / "reaper.yaml", box.table, dsn, kafka, {})
    logs = [tmp_path / "first.log", tmp_path / "second.log"]
    first = s.reaper_process(config, logs[0])
    second = None
    try:
        s.stash(box.table, 20, topic)
        drained(box.table, [first])
        # PostgreSQL: the new password in the role and the file; the reaper's sessions are ended
        # (a failover, a restart of the server), and it connects again with the new one.
        with psycopg.connect(s.pg_dsn(), autocommit=True) as conn:
            conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(box.runtime), NEW_PASSWORD))
            pgpass(passfile, NEW_PASSWORD)
            ended = conn.execute(
                "SELECT pg_terminate_backend(pid) FROM pg_stat_activity WHERE usename = %s", (box.runtime,)
            )
            assert ended.fetchall(), "the reaper had no session"
        s.stash(box.table, 20, topic)
        drained(box.table, [first])
        # Kafka: a new SCRAM password leaves authenticated connections alone; the restarted reaper
        # reads the new one from the file.
        upsert = UserScramCredentialUpsertion(
            user, ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096), NEW_PASSWORD.encode()
        )
        admin = s.admin()  # kept: a client collected before its futures end fails them
        for f in admin.alter_user_scram_credentials([upsert]).values():
            f.result(30)
        kafka_secret.write_text(NEW_PASSWORD + "\n")
        s.stash(box.table, 20, topic)
        drained(box.table, [first])
        first.terminate()
        assert first.wait(60) == 0
        second = s.reaper_process(config, logs[1])
        s.stash(box.table, 20, topic)
        drained(box.table, [second])
    finally:
        for p in (first, second):
            if p is not None and p.poll() is None:
                p.terminate()
                p.wait(60)
    security = s.kafka_config()
    got = read_messages(security.pop("bootstrap.servers"), [topic], 80, **security)
    # Four rounds of values v1..v20: each at least four times (at least once per round: a session
    # ended between publishing and purging sends its batch again).
    counts = Counter(int(text(m.value())[1:]) for m in got)
    assert sorted(counts) == list(range(1, 21)) and min(counts.values()) >= 4, counts
    for log in logs:
        output = log.read_text()
        assert s.PASSWORD not in output and NEW_PASSWORD not in output

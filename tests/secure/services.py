"""The secure services (``deploy/local/services.sh start-secure``) and what a test makes on them: an
owner role that migrates, a runtime role given ``reaper grants``' output and nothing more, a Kafka
principal with a SCRAM password and exactly the ACLs the test names, and the reaper file for them."""

from __future__ import annotations

import fcntl
import os
import subprocess
from collections.abc import Iterable
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import psycopg
import yaml

# confluent_kafka.admin imports these from its submodules without re-exporting them explicitly (as
# tests/support/kafka.py's set_topic_config says).
from confluent_kafka.admin import (  # type: ignore[attr-defined]
    AclBinding,
    AclOperation,
    AclPermissionType,
    AdminClient,
    ResourcePatternType,
    ResourceType,
    ScramCredentialInfo,
    ScramMechanism,
    UserScramCredentialUpsertion,
)
from confluent_kafka.cimpl import NewTopic
from psycopg import sql

from tests.support.names import unique
from tests.support.paths import ROOT, SERVICES
from tests.support.private_services import QUICK_JVM
from tests.support.reaper import REAPER, reaper_environment, run_reaper

PG_PORT = 5442
KAFKA_PORT = 9192
STATE = Path(os.environ.get("HARVESTER_LOCAL_DIR") or ROOT / ".local") / "secure"  # as services.sh places it
CA = STATE / "tls" / "ca.crt"
PASSWORD = "rt-secret-pw"  # the runtime role's and principal's; the tests look for it in every log line


def start() -> None:
    """Start them, or find them running: under a lock, since both test workers may ask at once (the
    Spark group's secure test runs beside tests/secure)."""
    STATE.parent.mkdir(parents=True, exist_ok=True)
    with (STATE.parent / "secure-start.lock").open("w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)  # released when the file is closed
        env = {**os.environ, "KAFKA_JVM_OPTIONS": QUICK_JVM}
        subprocess.run(["bash", str(SERVICES), "start-secure"], check=True, stdout=subprocess.DEVNULL, env=env)


def pg_dsn(user: str = "harvester", password: str = "local-dev-secret", **extra: str) -> str:
    """verify-full against the throwaway CA, to the name in the certificate (``hostaddr``: IPv4 only)."""
    params = {
        "host": "localhost",
        "hostaddr": "127.0.0.1",
        "port": str(PG_PORT),
        "user": user,
        "password": password,
        "dbname": "harvester",
        "sslmode": "verify-full",
        "sslrootcert": str(CA),
        **extra,
    }
    return " ".join(f"{k}={v}" for k, v in params.items())


def kafka_config(user: str = "admin", password: str = "local-admin-secret", **extra: Any) -> dict[str, Any]:
    return {
        "bootstrap.servers": f"localhost:{KAFKA_PORT}",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": user,
        "sasl.password": password,
        "ssl.ca.location": str(CA),
        "broker.address.family": "v4",  # the listener is on 127.0.0.1; "localhost" may resolve to ::1 first
        **extra,
    }


def admin() -> AdminClient:
    return AdminClient(kafka_config())


def create_topics(names: Iterable[str], partitions: int = 1) -> None:
    client = admin()  # kept: a client collected before its futures end fails them
    futures = client.create_topics([NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names])
    for f in futures.values():
        f.result(30)


@dataclass(frozen=True)
class Acl:
    """One ALLOW rule for the test's principal."""

    resource: ResourceType
    name: str
    operation: AclOperation
    pattern: ResourcePatternType = ResourcePatternType.LITERAL


def principal(acls: Iterable[Acl]) -> str:
    """A new SCRAM user with ``acls`` and nothing more; its password is :data:`PASSWORD`."""
    user = unique("rt")
    client = admin()
    scram = ScramCredentialInfo(ScramMechanism.SCRAM_SHA_512, 4096)
    upsert = UserScramCredentialUpsertion(user, scram, PASSWORD.encode())
    for f in client.alter_user_scram_credentials([upsert]).values():
        f.result(30)
    grant(user, acls)
    return user


def grant(user: str, acls: Iterable[Acl]) -> None:
    bindings = [
        AclBinding(a.resource, a.name, a.pattern, f"User:{user}", "*", a.operation, AclPermissionType.ALLOW)
        for a in acls
    ]
    if bindings:
        client = admin()
        for f in client.create_acls(bindings).values():
            f.result(30)


@dataclass(frozen=True)
class Outbox:
    """A schema owned by an owner role, migrated by ``reaper migrate`` as that owner."""

    schema: str
    owner: str
    runtime: str

    @property
    def table(self) -> str:
        return f"{self.schema}.outbox"


def outbox(tmp: Path, harvest: dict[str, Any]) -> Outbox:
    """Owner and runtime roles of their own; the owner migrates; the runtime role gets ``reaper grants``."""
    schema, owner, runtime = unique("s"), unique("own"), unique("rt")
    with psycopg.connect(pg_dsn(), autocommit=True) as conn:
        conn.execute(sql.SQL("CREATE ROLE {} LOGIN PASSWORD {}").format(sql.Identifier(owner), PASSWORD))
        conn.execute(sql.SQL("CREATE SCHEMA {} AUTHORIZATION {}").format(sql.Identifier(schema), sql.Identifier(owner)))
        if harvest.get("source") == "log":  # creating the publication and the slot
            conn.execute(sql.SQL("ALTER ROLE {} REPLICATION").format(sql.Identifier(owner)))
            conn.execute(sql.SQL("GRANT CREATE ON DATABASE harvester TO {}").format(sql.Identifier(owner)))
    made = Outbox(schema, owner, runtime)
    as_owner = write(tmp / "owner.yaml", made.table, pg_dsn(owner, PASSWORD), {}, harvest)
    done = run_reaper("migrate", "-f", str(as_owner))
    assert done.returncode == 0, done.stderr
    as_runtime = write(tmp / "grants.yaml", made.table, pg_dsn(runtime, PASSWORD), {}, harvest)
    script = run_reaper("grants", "-f", str(as_runtime))
    assert script.returncode == 0, script.stderr
    with psycopg.connect(pg_dsn(), autocommit=True) as conn:  # a superuser: REPLICATION needs one
        conn.execute(script.stdout.encode())
        conn.execute(sql.SQL("ALTER ROLE {} PASSWORD {}").format(sql.Identifier(runtime), PASSWORD))
    return made


def write(path: Path, table: str, dsn: str, kafka: dict[str, Any], harvest: dict[str, Any]) -> Path:
    settings = {
        "harvest": {
            "dataSource": dsn,
            "outboxTable": table,
            "baseKafkaConfig": kafka or kafka_config(),
            "limits": {"ioErrorBackoff": "100ms"},
            **harvest,
        },
        "logging": {"level": "info", "format": "json"},
        "http": {"port": 0},
    }
    path.write_text(yaml.safe_dump(settings))
    return path


def reapers(*commands: list[str], timeout: float = 90) -> list[subprocess.CompletedProcess[str]]:
    """Several ``reaper`` commands at once, each to completion (their interpreters start in parallel)."""
    procs = [
        subprocess.Popen(
            [*REAPER, *args],
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            stdin=subprocess.DEVNULL,
            text=True,
            env=reaper_environment(),
            cwd=ROOT,
        )
        for args in commands
    ]
    done = []
    for args, proc in zip(commands, procs, strict=True):
        out, err = proc.communicate(timeout=timeout)
        done.append(subprocess.CompletedProcess(args, proc.returncode, out, err))
    return done


def reaper_process(config: Path, log: Path) -> subprocess.Popen[bytes]:
    with log.open("wb") as out:
        return subprocess.Popen(
            [*REAPER, "run", "-f", str(config)],
            stdout=out,
            stderr=subprocess.STDOUT,
            stdin=subprocess.DEVNULL,
            env=reaper_environment(),
            cwd=ROOT,
        )


def stash(table: str, count: int, topic: str, keys: int = 5) -> None:
    with psycopg.connect(pg_dsn(), autocommit=True) as conn:
        schema, name = table.split(".")
        conn.execute(
            sql.SQL(
                "INSERT INTO {} (create_time, kafka_topic, kafka_key, kafka_value, kafka_header_keys,"
                " kafka_header_values) SELECT now(), %s, 'k' || (i %% %s), 'v' || i, '{{}}', '{{}}'"
                " FROM generate_series(1, %s) i"
            ).format(sql.Identifier(schema, name)),
            (topic, keys, count),
        )


def backlog(table: str) -> int:
    schema, name = table.split(".")
    with psycopg.connect(pg_dsn(), autocommit=True) as conn:
        row = conn.execute(sql.SQL("SELECT count(*) FROM {}").format(sql.Identifier(schema, name))).fetchone()
    assert row is not None
    return int(row[0])

"""One reaper, several outboxes, through the real `reaper` command on real PostgreSQL and Kafka: both
drain; one outbox's table dropped mid-run stalls nothing of the other; a table missing at start is
retried in the background and harvested once it exists; sections that share a table or a leader
group are refused in one line; migrate, status and dlq work on every section."""

from __future__ import annotations

import json
import signal
import subprocess
from collections.abc import Callable, Iterator
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families
from psycopg import sql

from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.migrations import dead_letter_table, fence_table
from tests.reaper.test_e2e import REAPER, Reaper, insert, outbox_count, wait_for
from tests.support.kafka import create_topics, delete_topics, read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

Conn = psycopg.Connection[tuple[object, ...]]


def write_config(path: Path, services: Services, *sections: dict[str, object]) -> Path:
    """A reaper file of several harvest sections, each on the test database and broker."""
    lines = ["harvest:"]
    for section in sections:
        lines.append(f"  - dataSource: '{services.pg_dsn}'")
        lines += [f"    {key}: {value}" for key, value in section.items()]
        lines.append(f"    baseKafkaConfig: {{bootstrap.servers: '{services.bootstrap}'}}")
        lines.append("    limits: {heartbeatTimeout: 2s}")
    lines += ["logging: {format: json}", ""]
    path.write_text("\n".join(lines), "utf-8")
    return path


def reaper(*args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run([REAPER, *args], check=False, capture_output=True, text=True, timeout=120)


def labelled(reaper: Reaper, name: str) -> dict[str, float]:
    """A series' samples by their ``outbox`` label, summed over shards."""
    found: dict[str, float] = {}
    for family in text_string_to_metric_families(reaper.get("/metrics")[1]):
        for s in family.samples:
            if s.name == name:
                found[s.labels["outbox"]] = found.get(s.labels["outbox"], 0.0) + s.value
    return found


@pytest.fixture
def tables(schema: str) -> tuple[TableName, TableName]:
    return TableName(schema, "orders_outbox"), TableName(schema, "users_outbox")


@pytest.fixture
def groups(services: Services) -> Iterator[tuple[str, str]]:
    made = (unique("group"), unique("group"))
    yield made
    delete_topics(services.bootstrap, [f"{g}.neli" for g in made])


@pytest.fixture
def topic(services: Services) -> Iterator[str]:
    name = unique("topic")
    create_topics(services.bootstrap, [name])
    yield name
    delete_topics(services.bootstrap, [name])


@pytest.fixture
def spawn(tmp_path: Path) -> Iterator[Callable[[Path], Reaper]]:
    started: list[Reaper] = []

    def start(config: Path) -> Reaper:
        started.append(Reaper(config, unique("reaper"), tmp_path))
        return started[-1]

    yield start
    for r in started:
        r.kill()


def test_two_outboxes_drain_and_a_dropped_table_stalls_nothing_of_the_other(
    services: Services,
    pg: Conn,
    tables: tuple[TableName, TableName],
    groups: tuple[str, str],
    topic: str,
    tmp_path: Path,
    spawn: Callable[[Path], Reaper],
) -> None:
    orders, users = tables
    config = write_config(
        tmp_path / "reaper.yaml",
        services,
        {"outboxTable": orders.qualified, "leaderGroupID": groups[0]},
        {"outboxTable": users.qualified, "leaderGroupID": groups[1], "shards": 2},
    )
    migrated = reaper("migrate", "-f", str(config))
    assert migrated.returncode == 0, migrated.stderr
    assert f"outbox table {orders}: applied" in migrated.stdout and f"outbox table {users}: applied" in migrated.stdout
    run = spawn(config)
    insert(pg, orders, topic, 0, 200)
    insert(pg, users, topic, 200, 200)
    wait_for("both outboxes drained", lambda: outbox_count(pg, orders) == 0 and outbox_count(pg, users) == 0)
    ready = run.ready()
    assert ready is not None and set(ready["outboxes"]) == {orders.qualified, users.qualified}  # type: ignore[call-overload]
    assert labelled(run, "harvester_records_purged_total") == {orders.qualified: 200.0, users.qualified: 200.0}

    status = reaper("status", "-f", str(config), "--json")
    assert status.returncode == 0, status.stderr
    assert [d["outbox_table"] for d in json.loads(status.stdout)] == [orders.qualified, users.qualified]

    pg.execute(sql.SQL("DROP TABLE {}").format(orders.ident))

    def dropped_reported() -> bool:
        status, body = run.get("/readyz")
        details = json.loads(body).get("outboxes", {}) if body else {}
        return status == 503 and details.get(orders.qualified, {}).get("outbox_ok") is False

    wait_for("the dropped table reported by /readyz", dropped_reported)
    insert(pg, users, topic, 400, 300)
    wait_for("the other outbox drained", lambda: outbox_count(pg, users) == 0)
    values = {m.value() for m in read_messages(services.bootstrap, [topic], 700, timeout=120)}
    assert values >= {f"value-{i}".encode() for i in range(700)}  # nothing of either outbox lost

    run.signal(signal.SIGTERM)
    assert run.exit_code(60) == 0, run.output()
    assert '"outbox": "' + users.qualified + '"' in run.output()  # log lines name their outbox


def test_a_missing_table_is_retried_in_the_background_while_the_other_drains(
    services: Services,
    pg: Conn,
    tables: tuple[TableName, TableName],
    groups: tuple[str, str],
    topic: str,
    tmp_path: Path,
    spawn: Callable[[Path], Reaper],
) -> None:
    orders, users = tables
    config = write_config(
        tmp_path / "reaper.yaml",
        services,
        {"outboxTable": orders.qualified, "leaderGroupID": groups[0]},
        {"outboxTable": users.qualified, "leaderGroupID": groups[1]},
    )
    only_users = write_config(tmp_path / "users.yaml", services, {"outboxTable": users.qualified})
    assert reaper("migrate", "-f", str(only_users)).returncode == 0
    run = spawn(config)
    insert(pg, users, topic, 0, 100)
    wait_for("the present outbox drained", lambda: outbox_count(pg, users) == 0)

    def missing_reported() -> bool:
        status, body = run.get("/readyz")
        details = json.loads(body).get("outboxes", {}) if body else {}
        return status == 503 and details.get(orders.qualified, {}).get("running") is False

    wait_for("the missing outbox reported as not running", missing_reported)
    assert run.proc.poll() is None  # the process goes on

    assert reaper("migrate", "-f", str(config)).returncode == 0  # creates the missing one, leaves the other
    insert(pg, orders, topic, 100, 100)
    wait_for("the created outbox harvested", lambda: outbox_count(pg, orders) == 0, timeout=120)
    wait_for("ready once every outbox runs", lambda: run.ready() is not None)
    run.signal(signal.SIGTERM)
    assert run.exit_code(60) == 0, run.output()


@pytest.mark.parametrize(
    ("second", "setting", "shown"),
    [
        ({"outboxTable": "public.a"}, "outboxTable", "public.a"),
        ({"outboxTable": "a"}, "outboxTable", "a"),  # unqualified: public's
        ({"outboxTable": "public.b", "leaderGroupID": "outbox-harvester.public.a"}, "leaderGroupID", None),
        ({"outboxTable": "public.b", "leaderTopic": "outbox-harvester.public.a.neli"}, "leaderTopic", None),
    ],
)
def test_sections_sharing_a_table_or_a_leader_group_are_refused_in_one_line(
    services: Services, tmp_path: Path, second: dict[str, object], setting: str, shown: str | None
) -> None:
    config = write_config(tmp_path / "reaper.yaml", services, {"outboxTable": "public.a"}, second)
    for command in ("run", "check"):
        result = reaper(command, "-f", str(config))
        assert result.returncode == 2
        assert result.stdout == ""
        lines = result.stderr.strip().splitlines()
        assert len(lines) == 1, result.stderr
        assert lines[0].startswith(f"reaper: configuration error: {config}: harvest[1].{setting}: ")
        assert "is already harvest[0]'s" in lines[0]
        if shown is not None:
            assert f": {shown} is already" in lines[0]


def test_dlq_chooses_its_outbox(services: Services, tables: tuple[TableName, TableName], tmp_path: Path) -> None:
    orders, users = tables
    config = write_config(
        tmp_path / "reaper.yaml", services, {"outboxTable": orders.qualified}, {"outboxTable": users.qualified}
    )
    assert reaper("migrate", "-f", str(config)).returncode == 0
    unchosen = reaper("dlq", "list", "-f", str(config))
    assert unchosen.returncode == 2
    assert unchosen.stderr.strip() == (
        f"reaper: error: --outbox: the configuration lists several outboxes ({orders.qualified}, "
        f"{users.qualified}); choose one"
    )
    chosen = reaper("dlq", "list", "-f", str(config), "--outbox", users.qualified)
    assert chosen.returncode == 0, chosen.stderr
    assert chosen.stdout.strip() == f"0 dead letter(s) in {dead_letter_table(users)}"
    unknown = reaper("dlq", "list", "-f", str(config), "--outbox", "public.nope")
    assert unknown.returncode == 2 and "--outbox: public.nope is not an outboxTable" in unknown.stderr


def test_a_section_that_stops_itself_is_retried_and_the_other_goes_on(
    services: Services,
    pg: Conn,
    tables: tuple[TableName, TableName],
    groups: tuple[str, str],
    topic: str,
    tmp_path: Path,
    spawn: Callable[[Path], Reaper],
) -> None:
    """The documented change of N, applied to one outbox under a running reaper: that section stops
    with the one-line reason and is started again in the background (refused again, as long as the
    file says the old N); the process and the other section go on."""
    orders, users = tables
    config = write_config(
        tmp_path / "reaper.yaml",
        services,
        {"outboxTable": orders.qualified, "leaderGroupID": groups[0], "shards": 2},
        {"outboxTable": users.qualified, "leaderGroupID": groups[1]},
    )
    assert reaper("migrate", "-f", str(config)).returncode == 0
    run = spawn(config)
    fence = fence_table(orders)
    count = sql.SQL("SELECT count(*) FROM {} WHERE outbox_table = %s").format(fence.ident)
    wait_for("both shards' terms", lambda: pg.execute(count, (orders.qualified,)).fetchone() == (2,))
    pg.execute(
        sql.SQL("UPDATE {} SET shards = 4, epoch = epoch + 1 WHERE outbox_table = %s").format(fence.ident),
        (orders.qualified,),
    )
    insert(pg, orders, topic, 0, 20)  # the fenced section's next term finds the other N
    reason = f"harvest.shards is 2 but {orders.qualified} is harvested with 4 shards"
    wait_for("the section retried", lambda: "outbox_start_failed" in run.output() and reason in run.output())
    insert(pg, users, topic, 20, 100)
    wait_for("the other outbox drained", lambda: outbox_count(pg, users) == 0)
    assert outbox_count(pg, orders) == 20  # nothing published under the wrong N
    status, body = run.get("/readyz")
    assert status == 503 and reason in json.loads(body)["outboxes"][orders.qualified]["error"]
    run.signal(signal.SIGTERM)
    assert run.exit_code(60) == 0, run.output()

"""``reaper run --workers 2`` on real PostgreSQL and Kafka: a supervisor and two reaper processes,
each a member of the leader group leading some of the 4 shards; every record drained in per-key
order; a worker SIGKILLed is started again and the shards are led again, nothing lost; SIGTERM stops
everything; the supervisor's endpoints speak for every worker."""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from collections.abc import Iterator
from pathlib import Path

import psycopg
import pytest
from prometheus_client.parser import text_string_to_metric_families

from harvester.postgres.schema.identifiers import TableName
from tests.engine.workload import check
from tests.reaper.test_e2e import REAPER, free_port, outbox_count, wait_for
from tests.support.kafka import create_topics, delete_topics, read_messages
from tests.support.names import unique
from tests.support.services import Services

pytestmark = pytest.mark.integration

KEYS = 12


def insert(pg: psycopg.Connection[tuple[object, ...]], table: TableName, topic: str, start: int, count: int) -> None:
    """Record ``i`` of key ``k`` has the value ``k:<its sequence number within the key>``."""
    rows = [(topic, f"k{i % KEYS}", f"k{i % KEYS}:{i // KEYS}") for i in range(start, start + count)]
    with pg.transaction(), pg.cursor() as cur:
        cur.executemany(
            f"INSERT INTO {table.quoted} (kafka_topic, kafka_key, kafka_value) VALUES (%s, %s, %s)",
            rows,
        )


class Supervisor:
    def __init__(self, config: Path, logs: Path) -> None:
        self.port = free_port()
        env = {k: v for k, v in os.environ.items() if not k.startswith("REAPER_")}
        env.update(REAPER_HTTP__PORT=str(self.port), REAPER_HTTP__HOST="127.0.0.1", REAPER_HARVEST__NAME="sup")
        self.log = logs / "supervisor.log"
        with self.log.open("w") as out:
            cmd = [REAPER, "run", "-f", str(config), "--workers", "2"]
            self.proc = subprocess.Popen(cmd, stdout=out, stderr=subprocess.STDOUT, env=env)

    def get(self, path: str) -> tuple[int, str]:
        try:
            with urllib.request.urlopen(f"http://127.0.0.1:{self.port}{path}", timeout=10) as resp:
                return resp.status, resp.read().decode()
        except urllib.error.HTTPError as err:
            return err.code, err.read().decode()
        except OSError:
            return 0, ""

    def workers(self) -> dict[str, dict[str, object]]:
        body = self.get("/readyz")[1]
        return json.loads(body)["workers"] if body else {}

    def leading(self) -> dict[str, list[int]]:
        """The shards each worker leads, by worker."""
        return {i: list(w.get("leading_shards") or []) for i, w in self.workers().items()}  # type: ignore[call-overload]


@pytest.fixture
def supervisor(tmp_path: Path) -> Iterator[list[Supervisor]]:
    made: list[Supervisor] = []
    yield made
    for s in made:
        if s.proc.poll() is None:
            s.proc.kill()
            s.proc.wait(10)


def test_two_workers_share_the_shards_survive_a_kill_and_stop_on_sigterm(
    services: Services,
    pg: psycopg.Connection[tuple[object, ...]],
    schema: str,
    tmp_path: Path,
    supervisor: list[Supervisor],
) -> None:
    table, group, topic = TableName(schema, "outbox"), unique("group"), unique("topic")
    create_topics(services.bootstrap, [topic])
    config = tmp_path / "reaper.yaml"
    config.write_text(
        f"harvest:\n  dataSource: '{services.pg_dsn}'\n  outboxTable: {table.qualified}\n"
        f"  leaderGroupID: {group}\n  shards: 4\n"
        f"  baseKafkaConfig: {{bootstrap.servers: '{services.bootstrap}'}}\n"
        "  limits: {heartbeatTimeout: 2s, minPollInterval: 100ms, minMetricsInterval: 1s}\n"
        "logging: {format: json}\nshutdown: {timeout: 15s}\n",
        "utf-8",
    )
    try:
        migrated = subprocess.run(
            [REAPER, "migrate", "-f", str(config)], check=False, capture_output=True, text=True, timeout=60
        )
        assert migrated.returncode == 0, migrated.stderr
        insert(pg, table, topic, 0, 240)
        sup = Supervisor(config, tmp_path)
        supervisor.append(sup)

        def both_lead() -> bool:
            leading = sup.leading()
            return (
                len(leading) == 2
                and all(leading.values())
                and sorted(s for shards in leading.values() for s in shards) == [0, 1, 2, 3]
            )

        wait_for("both workers leading shards, every shard led once", both_lead, timeout=90)
        wait_for("the outbox drained", lambda: outbox_count(pg, table) == 0)
        fence = pg.execute(
            f"SELECT shard, leader_id FROM {schema}.harvester_fence WHERE outbox_table = %s",
            (table.qualified,),
        ).fetchall()
        assert sorted(int(str(s)) for s, _ in fence) == [0, 1, 2, 3]

        def by_worker(name: str) -> dict[str, float]:
            found: dict[str, float] = {}
            for family in text_string_to_metric_families(sup.get("/metrics")[1]):
                for sample in family.samples:
                    if sample.name == name:
                        worker = sample.labels["worker"]
                        found[worker] = found.get(worker, 0.0) + sample.value
            return found

        def purged() -> dict[str, float]:
            return by_worker("harvester_records_purged_total")

        # Both workers' series, merged by the supervisor (counters are published every second).
        wait_for("every purge counted", lambda: sum(purged().values()) == 240)
        assert set(purged()) == {"0", "1"}
        assert by_worker("harvester_worker_restarts_total") == {"0": 0.0, "1": 0.0}

        victim = sup.workers()["0"]["pid"]
        assert isinstance(victim, int)
        os.kill(victim, signal.SIGKILL)
        insert(pg, table, topic, 240, 240)
        wait_for("worker 0 started again", lambda: sup.workers()["0"]["pid"] not in (victim, None), timeout=60)
        wait_for("the shards led again by both", both_lead, timeout=90)
        wait_for("the outbox drained again", lambda: outbox_count(pg, table) == 0)
        assert sup.get("/healthz")[0] == 200
        assert by_worker("harvester_worker_restarts_total") == {"0": 1.0, "1": 0.0}

        verdict = check(read_messages(services.bootstrap, [topic], 480, timeout=60), {f"k{k}": 40 for k in range(KEYS)})
        assert not verdict.lost and not verdict.out_of_order and not verdict.unexpected, verdict

        sup.proc.send_signal(signal.SIGTERM)
        assert sup.proc.wait(60) == 0, sup.log.read_text()
        log = sup.log.read_text()
        assert '"event": "worker_ended"' in log and "SIGKILL" in log
        assert '"restarts": 1' in log  # worker 0's second start
        assert log.count('"event": "reaper_stopped"') == 3  # both workers and the supervisor
        assert '"instance": "sup-w0"' in log and '"instance": "sup-w1"' in log
    finally:
        delete_topics(services.bootstrap, [topic, f"{group}.neli"])


def test_a_worker_past_the_shutdown_deadline_is_killed_and_the_exit_is_1(tmp_path: Path) -> None:
    """Real processes, no services: one worker stops on SIGTERM, one ignores it; the supervisor's stop
    kills the second at the deadline and reports failure, as one process past its deadline exits 1."""
    from harvester.daemon.workers import Worker, stop_workers

    ready = tmp_path / "ignoring"
    obeys = [sys.executable, "-c", "import time; time.sleep(60)"]
    ignores = [
        sys.executable,
        "-c",
        "import pathlib, signal, sys, time; signal.signal(signal.SIGTERM, signal.SIG_IGN); "
        "pathlib.Path(sys.argv[1]).touch(); time.sleep(60)",
        str(ready),
    ]
    workers = [Worker(0, obeys, tmp_path), Worker(1, ignores, tmp_path)]
    for w in workers:
        w.start()
    wait_for("the second worker ignoring SIGTERM", ready.exists)
    assert stop_workers(workers, signal.SIGTERM, 1.0) == 1
    codes = [w.proc.returncode for w in workers if w.proc is not None]
    assert codes == [-signal.SIGTERM, -signal.SIGKILL]


def test_a_worker_that_cannot_start_ends_the_supervisor_with_exit_2(tmp_path: Path) -> None:
    """A worker's exit 2 before it ever started is a configuration mistake, not a restart loop."""
    from harvester.daemon.errors import FailError
    from harvester.daemon.workers import Worker

    worker = Worker(0, [sys.executable, "-c", "raise SystemExit(2)"], tmp_path)
    worker.start()
    assert worker.proc is not None
    worker.proc.wait(30)
    with pytest.raises(FailError, match="worker 0 could not start"):
        worker.tend()


def test_workers_without_a_writable_temporary_directory_stop_in_one_line_naming_tmpdir(
    tmp_path: Path, monkeypatch: pytest.MonkeyPatch
) -> None:
    from harvester.daemon.errors import FailError
    from harvester.daemon.workers import port_directory

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path / "missing"))  # as a TMPDIR nobody can write
    with pytest.raises(FailError, match="set TMPDIR to a writable directory") as raised:
        port_directory()
    assert raised.value.code == 2 and "\n" not in str(raised.value)

"""One short fault scenario: writers filling an outbox, harvester processes each with its own
paths to PostgreSQL and Kafka (direct, through a proxy, or to a cluster), then the chaos checker
(``tests/chaos/harness.py``) over everything written: lost, per-key order, duplicates."""

from __future__ import annotations

import time
from collections.abc import Sequence
from dataclasses import dataclass, field
from typing import Any

import psycopg
import structlog.testing
from confluent_kafka import Consumer, KafkaException, TopicPartition
from confluent_kafka.admin import AdminClient
from confluent_kafka.cimpl import NewTopic
from psycopg import sql

from tests.chaos.harness import (
    ChaosSettings,
    Findings,
    HarvesterGroup,
    Tables,
    Writers,
    analyse,
    broken_guarantees,
    read_all,
)
from tests.engine.workload import wait_drained
from tests.proc.processes import HarvesterProcess
from tests.support.kafka import delete_topics
from tests.support.names import unique


def settings(delivery: str = "at_least_once", **overrides: Any) -> ChaosSettings:
    """A small workload (~100 records/s over 200 keys and 2 hot ones) with fast failover."""
    base: dict[str, Any] = {
        "seed": 22,
        "delivery": delivery,
        "keys": 200,
        "hot_keys": 2,
        "writers": 2,
        "records_per_second": 100.0,
        "max_per_txn": 4,
        "topics": 1,
        "partitions": 3,
        "drain_timeout": 120.0,
    }
    return ChaosSettings(**{**base, **overrides})


@dataclass
class Outcome:
    """What the checker found after a scenario."""

    delivery: str
    findings: Findings
    left_in_outbox: int
    records_written: int
    writer_errors: list[str]
    timeline: list[str]
    notes: list[str] = field(default_factory=list)

    def violations(self) -> list[str]:
        out = broken_guarantees(self.findings, self.delivery)
        if self.left_in_outbox:
            out.append(f"outbox not drained: {self.left_in_outbox} records left")
        if self.findings.records_read < self.records_written:
            out.append(f"{self.findings.records_read} records read of {self.records_written} written")
        return out + [f"writer failed: {e}" for e in self.writer_errors]

    def explain(self) -> str:
        lost = [f"lost: {', '.join(self.findings.lost[:20])}"] if self.findings.lost else []
        order = [f"order {k}: {' '.join(v[:30])}" for k, v in list(self.findings.out_of_order.items())[:5]]
        return "\n".join([*self.violations(), *lost, *order, *self.notes, "events:", *self.timeline])


class Scenario:
    """Tables and topics of one scenario, its writers and its harvester processes.

    ``dsn`` and ``bootstrap`` are the direct paths (writers, checker, and harvesters not given
    paths of their own)."""

    def __init__(
        self,
        settings: ChaosSettings,
        dsn: str,
        bootstrap: str,
        *,
        topic_config: dict[str, str] | None = None,
        **limits: Any,
    ) -> None:
        self.settings = settings
        self.dsn = dsn
        self.bootstrap = bootstrap
        self.tables = Tables.create(dsn, settings)
        self.topics = [unique("faults") for _ in range(settings.topics)]
        admin = AdminClient({"bootstrap.servers": bootstrap})
        # Replication at the broker's default: 3 on the cluster, 1 on a single broker.
        made = admin.create_topics(
            [
                NewTopic(t, num_partitions=settings.partitions, replication_factor=-1, config=topic_config or {})
                for t in self.topics
            ]
        )
        for f in made.values():
            f.result(30)
        self.group = HarvesterGroup(settings, dsn, self.tables.outbox, bootstrap)
        self.writers = Writers(settings, dsn, self.tables, self.topics)
        self._limits = limits
        self._t0 = time.time()

    def __enter__(self) -> Scenario:
        return self

    def __exit__(self, kind: type[BaseException] | None, *_: object) -> None:
        self.close(keep=kind is not None)

    @property
    def leader_group(self) -> str:
        """The harvesters' election group."""
        return str(self.group.spec("any")["leader_group_id"])

    def wait_group(self, members: int, timeout: float = 60.0) -> None:
        """Until the election group is stable with ``members`` members. A path cut while a new
        member's join still rebalances the group can leave the cut member's rejoin pending for the
        rebalance timeout (max.poll.interval, 300 s): a test of the failover cuts a settled group."""
        admin = AdminClient({"bootstrap.servers": self.bootstrap})
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:
                found = [g for g in admin.list_groups(self.leader_group, timeout=5) if g.id == self.leader_group]
            except KafkaException:
                found = []
            if found and found[0].state == "Stable" and len(found[0].members) == members:
                return
            time.sleep(0.2)
        raise RuntimeError(f"the election group did not settle with {members} members in {timeout:.0f} s")

    def spawn(self, name: str, *, dsn: str | None = None, bootstrap: str | None = None) -> HarvesterProcess:
        """Start a harvester process, on its own paths if given."""
        spec = self.group.spec(name)
        spec["limits"] = {**spec["limits"], **self._limits}
        if dsn is not None:
            spec["data_source"] = dsn
        if bootstrap is not None:
            spec["base_kafka_config"] = {**spec["base_kafka_config"], "bootstrap.servers": bootstrap}
        proc = HarvesterProcess(spec)
        self.group.running.append(proc)
        return proc

    def spawn_leader(self, name: str, **paths: str) -> HarvesterProcess:
        """Start a process and wait until it leads (the first process of a scenario leads)."""
        proc = self.spawn(name, **paths)
        if not proc.wait_for("LeaderAcquired", 60.0):
            raise RuntimeError(f"{name} did not become leader: {''.join(proc.log[-5:])}")
        return proc

    def published(self) -> int:
        """Messages in the scenario's topics now (end offsets)."""
        deadline = time.monotonic() + 90.0
        while True:
            # A fresh client each time: one that knew a broker just killed keeps asking it.
            c = Consumer({"bootstrap.servers": self.bootstrap, "group.id": unique("ends")})
            try:
                return sum(
                    c.get_watermark_offsets(TopicPartition(t, p), timeout=5)[1]
                    for t in self.topics
                    for p in range(self.settings.partitions)
                )
            except KafkaException:
                if time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
            finally:
                c.close()

    def wait_written(self, records: int, timeout: float = 120.0) -> None:
        """Wait until the writers committed ``records`` more records than now."""
        target = self.writers.records + records
        deadline = time.monotonic() + timeout
        while self.writers.records < target:
            if self.writers.errors or time.monotonic() > deadline:
                raise RuntimeError(f"writers stalled at {self.writers.records} records: {self.writers.errors}")
            time.sleep(0.1)

    def wait_published(self, records: int, timeout: float = 120.0) -> None:
        """Wait until the topics hold ``records`` more messages than now."""
        target = self.published() + records
        deadline = time.monotonic() + timeout
        while self.published() < target:
            if time.monotonic() > deadline:
                raise RuntimeError(f"nothing harvested within {timeout:.0f}s")
            time.sleep(0.2)

    def first_purge_after(self, wall: float) -> float | None:
        """Seconds from ``wall`` (time.time()) to the first purge after it, by any process."""
        with psycopg.connect(self.dsn) as conn:
            row = conn.execute(
                sql.SQL(
                    "SELECT extract(epoch FROM min(at)) FROM {} WHERE kind = 'DELETE' AND at > to_timestamp(%s)"
                ).format(self.tables.audit.ident),
                (wall,),
            ).fetchone()
        return None if row is None or row[0] is None else float(row[0]) - wall

    def finish(self) -> Outcome:
        """Stop the writers, wait for the outbox to drain, read every topic back and check it."""
        self.writers.stop()
        left = wait_drained(self.dsn, self.tables.outbox, self.settings.drain_timeout)
        expected = self.tables.expected(self.dsn)
        raw = read_all(self.bootstrap, self.topics, self.settings.partitions, 120.0)
        with structlog.testing.capture_logs():
            deduped = read_all(self.bootstrap, self.topics, self.settings.partitions, 120.0, dedup=True)
        findings = analyse(raw, deduped, expected, self.tables.undelivered(self.dsn))
        return Outcome(
            delivery=self.settings.delivery,
            findings=findings,
            left_in_outbox=left,
            records_written=self.writers.records,
            writer_errors=self.writers.errors,
            timeline=self.group.timeline(self._t0),
        )

    def close(self, keep: bool = False) -> None:
        """Stop everything; drop the tables and topics unless ``keep`` (a failed run's evidence, when
        the processes' timeline and last log lines are printed too: pytest shows them with the failure)."""
        self.writers.stop()
        self.group.stop()
        if keep:
            print("harvester events:", *self.group.timeline(self._t0), sep="\n  ")
            for name, tail in self.group.log_tails(30, retired=True).items():
                print(f"last log lines of {name}:", *tail, sep="\n  ")
        if not keep:
            self.tables.drop(self.dsn)
            delete_topics(self.bootstrap, self.topics)


def exit_counters(procs: Sequence[HarvesterProcess]) -> dict[str, dict[str, Any]]:
    """The final counters line of each (already stopped) process."""
    return {p.name: next((e for e in p.events if e["event"] == "exit"), {}) for p in procs}

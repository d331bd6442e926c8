"""A chaos run's settings, its fault kinds and the delivery modes it covers."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Literal, get_args

from harvester import HarvesterConfig

Log = Callable[[str], None]

FAULT_KINDS = ("kill_leader", "stop_leader", "restart_kafka", "restart_postgres", "terminate_connections")
# After every kind has run once, faults are drawn with these weights: a broker restart takes ~20 s
# on a small machine, so it is rarer than the cheap faults.
FAULT_WEIGHTS = {
    "kill_leader": 3,
    "stop_leader": 3,
    "restart_kafka": 1,
    "restart_postgres": 2,
    "terminate_connections": 3,
}


def delivery_modes() -> tuple[str, ...]:
    """The delivery modes the harvester accepts: the choices of ``HarvesterConfig.delivery``."""
    return tuple(str(mode) for mode in get_args(HarvesterConfig.model_fields["delivery"].annotation))


@dataclass(frozen=True)
class ChaosSettings:
    """One chaos run. Defaults suit a CI run on a small shared machine (~250 records/s)."""

    seed: int
    fault_seconds: float = 90.0
    delivery: str = "at_least_once"
    source: str = "mark_purge"  # HarvesterConfig.source
    log_messages: bool = False  # HarvesterConfig.log_messages: a table-less outbox (source log)
    log_retention: float = 0.0  # HarvesterConfig.log_retention in seconds (source log, a table)
    key_release: str | None = None  # HarvesterConfig.key_release (None: its default)
    # HarvesterConfig.layout: "debezium" writes Debezium's outbox layout, each row deleted in the
    # transaction that inserted it (source log)
    layout: Literal["goharvest", "debezium"] = "goharvest"
    keys: int = 3000
    hot_keys: int = 4
    writers: int = 4
    records_per_second: float = 250.0
    max_per_txn: int = 6
    # Every this many seconds (0: never) the first writer commits a transaction of large_txn records
    # instead: with the log source, the harvesters' sessions set logical_decoding_work_mem to its
    # least (64 kB), so that the server streams it while in progress (harvester/postgres/log/streamed.py).
    large_every: float = 0.0
    large_txn: int = 400
    hot_share: float = 0.3  # share of a writer's records that go to its hot key
    topics: int = 2
    partitions: int = 3
    harvesters: int = 3
    faults: tuple[str, ...] = FAULT_KINDS  # the kinds drawn (each at least once)
    shards: int = 1  # with more, every process may lead some shards; faults hit one that leads any
    min_gap: float = 2.0  # seconds between the end of one fault and the start of the next
    max_gap: float = 8.0
    heartbeat_timeout: float = 2.0
    session_timeout: float = 3.0
    drain_timeout: float = 180.0
    pg_port: int = 15432
    kafka_port: int = 29092

    @property
    def variant(self) -> str:
        """The source's variant, as the summary names it ("" for the defaults)."""
        if self.key_release:
            return f" (keyRelease {self.key_release})"
        if self.log_messages:
            return " (table-less)"
        if self.layout == "debezium":
            return " (Debezium's layout, insert-then-delete)"
        return f" (retention {self.log_retention:g}s)" if self.log_retention else ""

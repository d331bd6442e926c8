"""A harvester in an OS process of its own, for failover tests: prints events as JSON lines.

    python -m tests.proc.run_harvester '<json: HarvesterConfig fields + "session_timeout">'

Stops gracefully on SIGTERM and prints a final ``{"event": "exit", ...}`` line with its counters. A
start that PostgreSQL or Kafka refuses (a service being restarted, as ``Harvester.start`` documents)
prints ``{"event": "start_refused", ...}`` and exits with :data:`START_REFUSED`: the harnesses start
another process, as an orchestrator would.
"""

from __future__ import annotations

import faulthandler
import json
import os
import signal
import sys
import threading
import time
from typing import Any

from confluent_kafka import KafkaException

from harvester import Harvester, HarvesterConfig
from harvester.core.events import Event, MeterRead
from harvester.core.protocols import StoreUnreachableError
from harvester.kafka.topics import KafkaUnreachableError
from leader import ElectorConfig, NeliElector
from leader.topic import LeaderTopicError
from tests.proc.processes import START_REFUSED


def emit(record: dict[str, Any]) -> None:
    sys.stdout.write(json.dumps({"t": time.time(), **record}) + "\n")
    sys.stdout.flush()


def main() -> None:
    faulthandler.enable()  # an abort (librdkafka's assertions) prints each thread's stack to the log
    # HarvesterProcess.terminate asks with SIGUSR1 where a process that does not stop is stuck.
    faulthandler.register(signal.SIGUSR1, all_threads=True)
    spec = json.loads(sys.argv[1])
    session_timeout = float(spec.pop("session_timeout", 3.0))
    config = HarvesterConfig.model_validate(spec)
    made: list[Harvester] = []  # the elector asks the harvester, built below, whether it reaches PostgreSQL
    elector = NeliElector(
        ElectorConfig(
            kafka_config=dict(config.base_kafka_config),
            group_id=config.group_id,
            topic=config.topic,
            heartbeat_timeout=config.limits.heartbeat_timeout.total_seconds(),
            heartbeat_interval=min(0.5, config.limits.heartbeat_timeout.total_seconds() / 4),
            min_poll_interval=config.limits.min_poll_interval.total_seconds(),
            session_timeout=session_timeout,
            group_heartbeat_interval=0.5,
            partitions=config.shards,
        ),
        healthy=lambda: all(h.database_reachable() for h in made),
    )

    def on_event(event: Event) -> None:
        if not isinstance(event, MeterRead):
            leader_id, shard = str(getattr(event, "leader_id", "")), getattr(event, "shard", 0)
            emit({"event": type(event).__name__, "leader_id": leader_id, "shard": shard})

    h = Harvester(config, on_event=on_event, elector=elector)
    made.append(h)
    done = threading.Event()

    def on_term(*_: object) -> None:
        # Ignored from here on: a second SIGTERM arriving while this one is inside done.set() would
        # run this handler again in the same thread and deadlock on the event's lock (seen once).
        signal.signal(signal.SIGTERM, signal.SIG_IGN)
        done.set()

    signal.signal(signal.SIGTERM, on_term)
    try:
        h.start()
    # KafkaException: the checkpoint topic's check refused (not unreachable)
    except (StoreUnreachableError, LeaderTopicError, KafkaUnreachableError, KafkaException) as exc:
        emit({"event": "start_refused", "error": str(exc)})
        os._exit(START_REFUSED)  # no clean stop: whatever the failed start left running ends with the process
    emit({"event": "started", "name": config.name})
    # A timed wait, as the reaper's own: a SIGTERM the kernel hands to another thread only flags the
    # main thread, and an untimed wait would never return to the interpreter to run the handler.
    while not done.wait(0.5):
        pass
    h.stop(timeout=10)
    shards = h.shard_metrics
    emit(
        {
            "event": "exit",
            "published": sum(m.published._value.get() for m in shards),
            "purged": sum(m.purged._value.get() for m in shards),
            "fenced_statements": sum(m.fenced_statements._value.get() for m in shards),
            "fenced": sum(m.fenced._value.get() for m in shards),
        }
    )


if __name__ == "__main__":
    main()

"""Keeping a member's other terms proven while a ``LeaderRevoked`` listener wraps up.

A revocation reaches the elector inside librdkafka's rebalance callback, on the election thread, and
the partition is released when the callback returns: a listener that waits for its work in flight
(a reaper's records, a Spark drain's micro-batch) holds the callback. The group's consumer cannot be
polled from inside its own callback, so before this the member's other terms got no heartbeat read
back while the listener waited, and a wait longer than ``heartbeat_timeout`` fenced them all.

So the listener runs on a thread of its own, and while it waits the election thread keeps sending
the heartbeats of the partitions it still owns and reads them back through a consumer outside the
group (assigned, never committing). A heartbeat read back proves the same whichever consumer reads
it: the member reaches the cluster and its own term's messages come back. (A fenced term's probe
also needs a commit of the group's consumer: that waits until the callback returned.)
"""

from __future__ import annotations

import threading
from collections.abc import Callable, Mapping
from typing import Any

from confluent_kafka import OFFSET_END, Consumer, Message, TopicPartition


def hold(
    listen: Callable[[], None],
    *,
    owned: Callable[[], list[int]],
    topic: str,
    consumer_config: Mapping[str, Any],
    pause: float,
    poll_batch: int,
    pulse: Callable[[], None],
    read: Callable[[Message], None],
) -> None:
    """Run ``listen`` on a thread of its own until it returns. Should it outlast ``pause``, call
    ``pulse`` (send what heartbeats are due) every ``pause`` and hand ``read`` the heartbeats read
    back from the partitions ``owned`` names, by a consumer outside the group."""
    done = threading.Event()

    def run() -> None:
        try:
            listen()
        finally:
            done.set()

    listener = threading.Thread(target=run, name="neli-revoke-listener", daemon=True)
    listener.start()
    if done.wait(pause):
        return
    watched = owned()
    if not watched:
        listener.join()
        return
    watcher = Consumer({**consumer_config, "enable.auto.commit": False})
    try:
        watcher.assign([TopicPartition(topic, p, OFFSET_END) for p in watched])
        while not done.is_set():
            pulse()
            for message in watcher.consume(poll_batch, pause):
                if message.error() is None and message.partition() in watched:
                    read(message)
    finally:
        watcher.close()
    listener.join()

"""The group lookup a leader makes before it yields (``leader.members``): right counts, and no abort
while the broker restarts.

``AdminClient.describe_consumer_groups`` with a short request timeout aborted the process on the
first restart of the broker (librdkafka's coordinator-request path, ``eonce->refcnt > 0``); chaos
runs lost harvester processes to it in both delivery modes.
"""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time
from collections.abc import Iterator
from contextlib import ExitStack

import pytest
from confluent_kafka import Consumer
from confluent_kafka.admin import AdminClient

from leader.members import group_members
from tests.support.kafka import create_topics, delete_topics
from tests.support.names import unique
from tests.support.paths import ROOT
from tests.support.private_services import PrivateKafka

pytestmark = [pytest.mark.integration, pytest.mark.slow]

# A member of the group, polled between lookups, so that they describe a group (not only list);
# the group is looked up every few milliseconds for ``seconds``, with the elector's short timeout.
_LOOKUPS = textwrap.dedent(
    """
    import sys, time
    from confluent_kafka import Consumer, KafkaException
    from confluent_kafka.admin import AdminClient
    from leader.members import group_members

    bootstrap, group, topic, seconds = sys.argv[1], sys.argv[2], sys.argv[3], float(sys.argv[4])
    admin = AdminClient({"bootstrap.servers": bootstrap, "log_level": 0})
    member = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "log_level": 0})
    member.subscribe([topic])
    found = failed = 0
    end = time.monotonic() + seconds
    while time.monotonic() < end:
        member.poll(0.05)
        try:
            found += group_members(admin, group, 0.5) == 1
        except KafkaException:
            failed += 1
    print(f"found {found} failed {failed}")
    """
)


@pytest.fixture
def topic(private_kafka: PrivateKafka) -> Iterator[str]:
    name = unique("members")
    create_topics(private_kafka.bootstrap, [name], partitions=2)
    yield name
    delete_topics(private_kafka.bootstrap, [name])


def _join(bootstrap: str, group: str, topic: str) -> Consumer:
    consumer = Consumer({"bootstrap.servers": bootstrap, "group.id": group, "session.timeout.ms": 6000})
    consumer.subscribe([topic])
    return consumer


def _wait_members(admin: AdminClient, group: str, count: int, consumers: list[Consumer]) -> int:
    deadline, seen = time.monotonic() + 30, -1
    while time.monotonic() < deadline:
        for c in consumers:
            c.poll(0.1)
        seen = group_members(admin, group, 2.0)
        if seen == count:
            break
    return seen


def test_counts_the_members_of_a_group(private_kafka: PrivateKafka, topic: str) -> None:
    admin = AdminClient({"bootstrap.servers": private_kafka.bootstrap})
    group = unique("members-group")
    assert group_members(admin, group, 5.0) == 0
    with ExitStack() as stack:
        first = _join(private_kafka.bootstrap, group, topic)
        stack.callback(first.close)
        assert _wait_members(admin, group, 1, [first]) == 1
        second = _join(private_kafka.bootstrap, group, topic)
        stack.callback(second.close)
        assert _wait_members(admin, group, 2, [first, second]) == 2


def test_lookups_survive_broker_restarts(private_kafka: PrivateKafka, topic: str) -> None:
    lookups = subprocess.Popen(
        [sys.executable, "-c", _LOOKUPS, private_kafka.bootstrap, unique("members-group"), topic, "30"],
        cwd=ROOT,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    time.sleep(2)
    private_kafka.restart()
    private_kafka.restart()
    out, err = lookups.communicate(timeout=120)
    assert lookups.returncode == 0, err[-2000:]
    assert int(out.split()[1]) > 0, out  # the member was found, between the restarts

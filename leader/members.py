"""How many members a consumer group has: the check a leader makes before it yields to another.

Asked with ListGroups and DescribeGroups sent to every broker (``AdminClient.list_groups``), not
with ``describe_consumer_groups``: the latter goes through librdkafka's coordinator-request path,
which aborts the whole process (``rd_kafka_enq_once_del_source_return: Assertion
`eonce->refcnt > 0' failed``, librdkafka 2.16) when a request times out while the coordinator's
broker restarts. Chaos runs hit that in both delivery modes, and a loop of such lookups aborts on
the first restart of its broker (``tests/leader/test_group_members.py`` runs one through two).
``list_groups`` waits on a queue of its own, which it disables on a timeout: a late answer is
dropped. confluent-kafka marks it deprecated (it warns on each call); the warning is silenced here,
for this one message only. ``reaper status`` reads the members' assignments the same way.
"""

from __future__ import annotations

import re
import struct
import warnings
from dataclasses import dataclass

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

warnings.filterwarnings("ignore", message=r"list_groups\(\) is deprecated", category=DeprecationWarning)

_I16, _I32 = struct.Struct("!h"), struct.Struct("!i")


@dataclass(frozen=True, slots=True)
class Member:
    """A member of a group, as its coordinator knows it."""

    member_id: str
    client_id: str
    host: str
    partitions: dict[str, list[int]]  # its assignment: topic -> partitions


@dataclass(frozen=True, slots=True)
class Group:
    """A group's state (``STABLE``, ``PREPARING_REBALANCE``, ...; ``DEAD`` when unknown) and members."""

    state: str
    members: list[Member]


def describe_group(admin: AdminClient, group_id: str, timeout: float) -> Group:
    """``group_id`` as its coordinator knows it.

    Raises :class:`confluent_kafka.KafkaException` when a broker does not answer within ``timeout``
    seconds or reports an error for the group.
    """
    for group in admin.list_groups(group_id, timeout=timeout):
        if group.id != group_id:
            continue
        if group.error is not None:
            raise KafkaException(group.error)
        members = [
            Member(str(m.id), str(m.client_id), str(m.client_host), assignment(m.assignment)) for m in group.members
        ]
        # The coordinator's own names (PreparingRebalance), spelt as the admin API's enum (PREPARING_REBALANCE).
        return Group(re.sub(r"(?<!^)(?=[A-Z])", "_", str(group.state)).upper(), members)
    return Group("DEAD", [])


def group_members(admin: AdminClient, group_id: str, timeout: float) -> int:
    """The members of ``group_id`` (0 for an unknown group); raises as :func:`describe_group`."""
    return len(describe_group(admin, group_id, timeout).members)


def assignment(data: bytes | None) -> dict[str, list[int]]:
    """A consumer's assignment in the consumer protocol's format (version, then each topic's name
    and partitions, then user data, which is left out); empty for no or foreign data."""
    partitions: dict[str, list[int]] = {}
    if not data or len(data) < 6:
        return partitions
    try:
        at = 2  # the version: every version starts with the same list
        (topics,) = _I32.unpack_from(data, at)
        at += 4
        for _ in range(max(topics, 0)):
            (size,) = _I16.unpack_from(data, at)
            topic = data[at + 2 : at + 2 + size].decode()
            at += 2 + size
            (count,) = _I32.unpack_from(data, at)
            at += 4
            partitions[topic] = [_I32.unpack_from(data, at + 4 * i)[0] for i in range(max(count, 0))]
            at += 4 * max(count, 0)
    except (struct.error, UnicodeDecodeError):
        return {}
    return partitions

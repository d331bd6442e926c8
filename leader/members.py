"""How many members a consumer group has: the check a leader makes before it yields to another.

Asked with ListGroups sent to every broker and DescribeGroups to the one that lists the group
(``AdminClient.list_groups``), not with ``describe_consumer_groups``: the latter goes through
librdkafka's coordinator-request path, which aborts the whole process
(``rd_kafka_enq_once_del_source_return: Assertion `eonce->refcnt > 0' failed``, librdkafka 2.16)
when a request times out while the coordinator's broker restarts. Chaos runs hit that in both
delivery modes, and a loop of such lookups aborts on the first restart of its broker
(``tests/leader/test_group_members.py`` runs one through two). ``list_groups`` waits on a queue of
its own, which it disables on a timeout: a late answer is dropped. Its limits suit the leader's
question, where "cannot tell" means "yield": it fails unless every broker answers, and it keeps
the last broker's error only, so a group whose coordinator still loads can be missed (0 members).
(``reaper status``, which must work with a broker down, keeps the admin API.) confluent-kafka marks
``list_groups`` deprecated (it warns on each call); the warning is silenced here, for this one
message only.
"""

from __future__ import annotations

import warnings

from confluent_kafka import KafkaException
from confluent_kafka.admin import AdminClient

warnings.filterwarnings("ignore", message=r"list_groups\(\) is deprecated", category=DeprecationWarning)


def group_members(admin: AdminClient, group_id: str, timeout: float) -> int:
    """The members of ``group_id`` as its coordinator knows them (0 for a group no broker listed).

    Raises :class:`confluent_kafka.KafkaException` when a broker does not answer within ``timeout``
    seconds or reports an error for the group.
    """
    count = 0
    for group in admin.list_groups(group_id, timeout=timeout):
        if group.id != group_id:
            continue
        if group.error is not None:
            raise KafkaException(group.error)
        count += len(group.members)
    return count

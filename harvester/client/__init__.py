"""What applications import: writing outbox records in their own transactions (:mod:`.stasher`,
:mod:`.async_stasher`; :mod:`.message_stasher` for a table-less outbox), and reading harvested
topics without duplicates (:mod:`.dedup`, a Kafka consumer, so imported on its own; its rule
without Kafka is :mod:`.dedup_state`). Importing this package loads neither the engine nor
confluent-kafka nor pyspark nor opentelemetry (the stashers load it on first stash, when installed)."""

from harvester.client.async_stasher import AsyncStasher
from harvester.client.message_stasher import AsyncMessageStasher, MessageStasher
from harvester.client.stasher import Stasher, stash
from harvester.core.identity import Identity, IdentityHeaders
from harvester.core.records import OutboxRecord, RecordError

__all__ = [
    "AsyncMessageStasher",
    "AsyncStasher",
    "Identity",
    "IdentityHeaders",
    "MessageStasher",
    "OutboxRecord",
    "RecordError",
    "Stasher",
    "stash",
]

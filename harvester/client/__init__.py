"""What applications import: writing outbox records in their own transactions (:mod:`.stasher`),
and reading harvested topics without duplicates (:mod:`.dedup`, a Kafka consumer, so imported on
its own). Importing this package loads neither the engine nor confluent-kafka nor pyspark."""

from harvester.client.stasher import Stasher, stash
from harvester.core.identity import Identity, IdentityHeaders
from harvester.core.records import OutboxRecord, RecordError

__all__ = ["Identity", "IdentityHeaders", "OutboxRecord", "RecordError", "Stasher", "stash"]

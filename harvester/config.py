"""Configuration of an embedded harvester: the outbox, Kafka, leader election, delivery, and the limits.

Field names are snake_case; every field also accepts goharvest's camelCase spelling, so a goharvest
``harvest:`` block validates unchanged. Durations accept Go-style strings (``100ms``, ``5s``).
Defaults are goharvest's where it has the setting, except those docs/reaper.md lists under "Differences
from goharvest".
"""

from __future__ import annotations

import os
import re
import socket
from datetime import timedelta
from typing import Any, Literal

from pydantic import (
    AliasChoices,
    BaseModel,
    ByteSize,
    Field,
    ValidationError,
    ValidatorFunctionWrapHandler,
    field_validator,
    model_validator,
)

from harvester.core.limits import BOTH_SPELLINGS, Duration, Limits
from harvester.event_router import EventRouter
from harvester.postgres.log.logical import LogSetup
from harvester.postgres.schema.identifiers import TableName
from harvester.postgres.schema.message_format import default_prefix

# Kafka's internal topics: a broker refuses records produced to them ("Invalid topic"), so a leader's
# heartbeats there never arrive. goharvest's reaper_secure.yaml names __consumer_offsets as its leader
# topic, where goneli takes other groups' offset commits for heartbeats.
_INTERNAL_TOPICS = frozenset({"__consumer_offsets", "__transaction_state", "__share_group_state"})

# PostgreSQL's rule for replication slot names; publications follow it too here, for symmetry.
_SLOT = re.compile(r"^[a-z0-9_]{1,63}$")


class HarvesterConfig(BaseModel):
    """Everything a :class:`harvester.Harvester` needs."""

    model_config = BOTH_SPELLINGS

    data_source: str = Field(
        # No password: a default must carry no secret. The local services trust loopback.
        default="host=127.0.0.1 port=5432 user=harvester dbname=harvester",
        description="libpq connection string (key=value or URL).",
    )
    outbox_table: str = Field(default="outbox")
    base_kafka_config: dict[str, Any] = Field(
        default_factory=lambda: {"bootstrap.servers": "127.0.0.1:9092"},
    )
    producer_kafka_config: dict[str, Any] = Field(default_factory=dict)
    leader_group_id: str | None = Field(
        default=None,
        validation_alias=AliasChoices("leader_group_id", "leaderGroupID", "leaderGroupId"),
        description="Consumer group of the competing harvesters; default: 'outbox-harvester.<table>'.",
    )
    leader_topic: str | None = Field(
        default=None,
        description="Topic whose partition 0 decides leadership; default: '<leader_group_id>.neli'.",
    )
    name: str = Field(
        default_factory=lambda: f"{socket.gethostname()}-{os.getpid()}",
        description="Instance name carried by every log line.",
    )
    listen_notify: bool = Field(
        default=True,
        description="Wake up on NOTIFY from the outbox trigger (installed by migration) when idle.",
    )
    delivery: Literal["at_least_once", "exactly_once"] = Field(
        default="at_least_once",
        description="exactly_once: each batch and its checkpoint commit in one Kafka transaction; consumers "
        "must read with isolation.level=read_committed.",
    )
    dead_letter_policy: Literal["release", "hold_key"] = Field(
        default="release",
        description="release: a dead letter's key moves on; hold_key: later records of that key wait until "
        "the dead letter is replayed or purged.",
    )
    checkpoint_topic: str | None = Field(
        default=None,
        description="Exactly-once checkpoints; default '<leader_group_id>.checkpoints'.",
    )
    identity_header_prefix: str = Field(
        default="outbox-",
        pattern=r"^[A-Za-z0-9._-]{1,64}$",
        description="Prefix of the identity headers (<prefix>id, <prefix>epoch, <prefix>producer).",
    )
    producer_name: str | None = Field(
        default=None,
        description="Stable producer name in the identity headers; default '<db system id>/<table>'.",
    )
    shards: int = Field(
        default=1,
        ge=1,
        le=256,
        description="Split the outbox's keys into this many shards, each harvested by its own leader "
        "(docs/sharding.md); every reaper of a group must use the same number.",
    )
    source: Literal["mark_purge", "log"] = Field(
        default="mark_purge",
        description="mark_purge: mark, publish, purge rows of the table; log: read the table's inserts from a "
        "logical replication slot (needs wal_level=logical; see docs/log-source.md).",
    )
    log_slot: str | None = Field(
        default=None, description="Replication slot of the log source; default 'harvester_<schema>_<table>'."
    )
    log_publication: str | None = Field(
        default=None, description="Publication of the log source; default the slot's name."
    )
    log_messages: bool = Field(
        default=False,
        description="With source log: a table-less outbox; the stashers write logical decoding messages "
        "(pg_logical_emit_message) instead of rows, and the log source reads those (PostgreSQL 14+).",
    )
    log_accept_loss_on_failover: bool = Field(
        default=False,
        description="With a table-less outbox: run even where a PostgreSQL failover would lose the records not "
        "yet delivered (no failover slot that a standby synchronizes; docs/log-source.md#failover).",
    )
    log_retention: Duration = Field(
        default=timedelta(0),
        description="With source log and a table: keep delivered rows this long, then delete them in bulk "
        "(0: delete them per batch as they are delivered).",
    )
    log_transaction_memory: ByteSize = Field(
        default=ByteSize(1 << 30),
        gt=0,
        description="With source log: the memory the transactions' records may take in the leader, all "
        "together (an estimate); past it, a large transaction's further records wait in a temporary file "
        "(in logSpillDirectory) until done.",
    )
    log_spill_directory: str | None = Field(
        default=None,
        min_length=1,
        description="With source log: the directory of those temporary files; default the system's temporary "
        "directory (TMPDIR, else /tmp). It must exist and be writable (checked at start).",
    )
    log_prefix: str | None = Field(
        default=None,
        description="The table-less outbox's message prefix; default 'harvester:<schema>.<table>'.",
    )
    producer_process: bool | None = Field(
        default=None,
        description="With at_least_once and a key released at its acknowledgement (keyRelease acknowledged, the "
        "default), where the Kafka producer's work per record runs, off the harvester's interpreter so that a "
        "second core publishes while the harvester's reads the slot or the table: unset, in the native loop in "
        "the harvester's process where it was built (./dev.sh, the image), else in a child process; true, in a "
        "child process (the native loop there, or its Python one); false, in the harvester's process through "
        "confluent-kafka.",
    )
    key_release: Literal["acknowledged", "purged"] | None = Field(
        default=None,
        description="With at_least_once, when a key's next record may go out: acknowledged (the default), at its "
        "previous record's acknowledgement, at most 8 of a key sent and not purged, in order (a crash repeats such "
        "a run); purged (goharvest's, mark_purge only; the default with deadLetterPolicy hold_key), after its "
        "previous record's purge committed, one record of a key in flight (a crash repeats a key's last record).",
    )
    layout: Literal["goharvest", "debezium"] = Field(
        default="goharvest",
        description="goharvest: the kafka_* columns (reaper migrate's table); debezium: the table Debezium's "
        "outbox EventRouter reads, mapped and routed by eventRouter (docs/migrating.md).",
    )
    event_router: EventRouter | None = Field(
        default=None,
        description="With layout debezium: EventRouter's options by its own names (table.field.event.key, "
        "route.by.field, route.topic.replacement, ...), as a connector's transforms.<name>.* properties.",
    )
    limits: Limits = Field(default_factory=Limits)

    @field_validator("log_slot", "log_publication")
    @classmethod
    def _slot_name(cls, value: str | None) -> str | None:
        if value is not None and not _SLOT.match(value):
            raise ValueError(f"{value!r}: 1-63 lower-case letters, digits or underscores")
        return value

    @field_validator("log_transaction_memory", mode="wrap")
    @classmethod
    def _size(cls, value: object, handler: ValidatorFunctionWrapHandler) -> ByteSize:
        try:
            size: ByteSize = handler(value)
        except ValidationError as exc:
            if any(e["type"] == "greater_than" for e in exc.errors()):
                raise
            raise ValueError(f"invalid size {value!r}: use forms like '512MiB', '2GB' or a number of bytes") from None
        return size

    @model_validator(mode="after")
    def _log_source(self) -> HarvesterConfig:
        if self.source == "log" and self.shards > 1:
            raise ValueError("source 'log' reads one replication slot: it does not support shards > 1")
        if self.log_messages and self.source != "log":
            raise ValueError("logMessages (a table-less outbox) needs source 'log'")
        if self.log_accept_loss_on_failover and not self.log_messages:
            raise ValueError("logAcceptLossOnFailover is about a table-less outbox: it needs logMessages")
        if self.log_retention and (self.source != "log" or self.log_messages):
            raise ValueError("logRetention needs source 'log' over a table (a table-less outbox deletes nothing)")
        if self.log_prefix is not None and not self.log_prefix:
            raise ValueError("logPrefix must not be empty")
        if self.source == "log" and self.dead_letter_policy == "hold_key":
            raise ValueError("source 'log' does not support deadLetterPolicy 'hold_key': use release")
        if self.source == "log" and self.key_release == "purged":
            raise ValueError(
                "source 'log' releases a key at its record's acknowledgement: keyRelease 'purged' is mark_purge's"
            )
        if self.key_release == "acknowledged" and self.dead_letter_policy == "hold_key":
            raise ValueError(
                "deadLetterPolicy 'hold_key' holds a key behind its dead letter, which keyRelease 'acknowledged'"
                " may have sent later records past: use keyRelease 'purged'"
            )
        return self._debezium()

    def _debezium(self) -> HarvesterConfig:
        if self.layout != "debezium":
            if self.event_router is not None:
                raise ValueError("eventRouter needs layout 'debezium'")
            return self
        if self.source != "log":
            # Mark-purge hands a key's rows out in the order of their sequence ids; the layout's id is
            # a UUID, so only the log, in commit order, knows a key's order.
            raise ValueError(
                "layout 'debezium' is read by source 'log': mark_purge orders a key's rows by a sequence id,"
                " which Debezium's table does not have (its id is a UUID)"
            )
        if self.log_messages:
            raise ValueError("layout 'debezium' is a table: it cannot be read with logMessages (a table-less outbox)")
        return self

    @model_validator(mode="before")
    @classmethod
    def _debezium_defaults(cls, data: Any) -> Any:
        """Layout debezium: EventRouter's defaults, and Java's partitioner unless one is set."""
        if not isinstance(data, dict) or data.get("layout") != "debezium":
            return data
        data = dict(data)
        if data.get("eventRouter", data.get("event_router")) is None:
            data["event_router"] = EventRouter()
        kafka = {**(data.get("baseKafkaConfig") or data.get("base_kafka_config") or {})}
        spelling = "producerKafkaConfig" if "producerKafkaConfig" in data else "producer_kafka_config"
        producer = dict(data.get(spelling) or {})
        if isinstance(kafka, dict) and "partitioner" not in {**kafka, **producer}:
            # Kafka Connect's producer places a key by murmur2, as Java clients do (librdkafka's default
            # is crc32): the same key, the same partition as Debezium's.
            data[spelling] = {**producer, "partitioner": "murmur2_random"}
        return data

    @property
    def slot(self) -> str:
        """The log source's replication slot."""
        default = re.sub(r"[^a-z0-9_]", "_", f"harvester_{self.table.qualified}".lower())
        return self.log_slot or default[:63]

    @property
    def prefix(self) -> str | None:
        """The table-less outbox's message prefix (None when the outbox is a table)."""
        if not self.log_messages:
            return None
        return self.log_prefix or default_prefix(self.table)

    @property
    def publication(self) -> str:
        """The log source's publication."""
        return self.log_publication or self.slot

    @property
    def log_setup(self) -> LogSetup:
        """The names the log source reads through (its store, ``reaper migrate`` and ``reaper check``)."""
        every = self.event_router is not None
        return LogSetup(self.table, self.slot, self.publication, self.prefix, self.log_accept_loss_on_failover, every)

    @field_validator("leader_topic")
    @classmethod
    def _leader_topic(cls, value: str | None) -> str | None:
        if value in _INTERNAL_TOPICS:
            raise ValueError(
                f"{value} is Kafka's internal topic, where the broker refuses the leader's heartbeats: "
                "name a topic of the group's own (leaderTopic: <leaderGroupID>.neli, which reaper run creates), "
                "or leave leaderTopic out for that default"
            )
        return value

    @field_validator("outbox_table")
    @classmethod
    def _table(cls, value: str) -> str:
        TableName.parse(value)
        return value

    @property
    def table(self) -> TableName:
        """The validated outbox table name."""
        return TableName.parse(self.outbox_table)

    @property
    def group_id(self) -> str:
        """The leader group id, defaulted from the table name."""
        return self.leader_group_id or f"outbox-harvester.{self.table.qualified}"

    @property
    def checkpoints(self) -> str:
        """The checkpoint topic of exactly-once mode."""
        return self.checkpoint_topic or f"{self.group_id}.checkpoints"

    @property
    def topic(self) -> str:
        """The leader topic, defaulted from the group id."""
        return self.leader_topic or f"{self.group_id}.neli"

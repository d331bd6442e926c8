"""What ``reaper status`` reports of one outbox (:mod:`.status` says where each part is read from),
as text or JSON."""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from datetime import datetime


@dataclass(frozen=True, slots=True)
class Member:
    """One reaper in the leader group."""

    name: str
    host: str
    member_id: str
    leads: bool
    shards: list[int] = field(default_factory=list)  # the shards (leader topic partitions) it holds


@dataclass(frozen=True, slots=True)
class Term:
    """The fence row: the latest leadership term that began."""

    leader_id: str | None
    epoch: int
    since: datetime


@dataclass(frozen=True, slots=True)
class Heartbeat:
    """The newest heartbeat on a partition of the leader topic: who sent it, for which term, how long
    ago, and the records its leader had in flight (None from a reaper that does not report them)."""

    member: str
    leader_id: str
    age_seconds: float  # by the sender's clock: the message's timestamp against this host's
    in_flight: int | None = None
    lag_seconds: float | None = None  # its leader's lag as its meter sampled it last


@dataclass(frozen=True, slots=True)
class Slot:
    """The log source's replication slot: how far it is behind and what it keeps in the log."""

    name: str
    lag_bytes: int  # WAL written after the slot's confirmed position
    retained_bytes: int  # WAL the server keeps for the slot (from its restart position)
    streaming: bool  # a reader (the leader's walsender) is attached


@dataclass(frozen=True, slots=True)
class Status:
    """What ``reaper status`` reports."""

    outbox_table: str
    group: str
    leader_topic: str
    delivery: str
    group_state: str
    members: list[Member]
    leader: str | None  # name of the member holding partition 0, None when nobody leads
    term: Term | None  # None when no reaper ever led over this outbox
    heartbeat: Heartbeat | None  # None when no heartbeat was ever sent
    heartbeat_timeout_seconds: float
    backlog_records: int
    oldest_record_age_seconds: float | None
    in_flight_records: int | None  # from the leaders' heartbeats: marks are kept in memory, not in the table
    dead_letters: int | None  # None without a dead-letter table
    shards: int = 1
    slot: Slot | None = None  # the log source's slot; None with mark-purge/reset, or when it is missing
    # The age of the oldest record committed and not acknowledged by Kafka; None when unknown (a log
    # source without per-batch deletes whose leaders' heartbeats do not report it).
    lag_seconds: float | None = None

    def to_json(self) -> str:
        doc = asdict(self)
        if self.term is not None:
            doc["term"]["since"] = self.term.since.isoformat()
        return json.dumps(doc, indent=2)

    def to_text(self) -> str:
        lines = [f"outbox {self.outbox_table}: delivery {self.delivery}; group {self.group}, topic {self.leader_topic}"]
        term = ""
        if self.term is not None:
            since = self.term.since.strftime("%Y-%m-%d %H:%M:%S %Z").strip()
            term = f"leader id {self.term.leader_id}, epoch {self.term.epoch}, since {since}"
        if self.leader is not None:
            lines.append(f"leader: {self.leader}" + (f"; {term}" if term else ""))
        else:
            lines.append(f"leader: none (no member holds partition 0 of {self.leader_topic})")
            if term:
                lines.append(f"last term: {term}")
        beat = self.heartbeat
        if beat is not None:
            lines.append(
                f"last heartbeat: {beat.age_seconds:.1f} s ago, from {beat.member}, leader id {beat.leader_id}"
            )
            if self.leader is not None and beat.age_seconds > self.heartbeat_timeout_seconds:
                lines.append(
                    f"warning: no heartbeat for more than harvest.limits.heartbeatTimeout "
                    f"({self.heartbeat_timeout_seconds:g} s): {self.leader} may have fenced itself "
                    "(or this host's clock is ahead of its)"
                )
        lines.append(f"members: {len(self.members)} (group {self.group_state.lower()})")
        if self.shards > 1:
            held = sorted(s for m in self.members for s in m.shards)
            unled = sorted(set(range(self.shards)) - set(held))
            lines.append(f"shards: {self.shards}" + (f"; without a leader: {unled}" if unled else "; every one led"))
            lines += [f"  {m.name}  host {m.host}  shards {m.shards}" for m in self.members]
        else:
            lines += [f"  {m.name}  host {m.host}{'  leads' if m.leads else ''}" for m in self.members]
        age = self.oldest_record_age_seconds
        lines.append(
            f"backlog: {self.backlog_records} record(s)" + (f", oldest {age:.1f} s old" if age is not None else "")
        )
        if self.lag_seconds is None:
            lines.append("lag: not reported (no leader's heartbeat carries it)")
        else:
            lines.append(f"lag: {self.lag_seconds:.1f} s (the oldest record committed and not acknowledged by Kafka)")
        if self.in_flight_records is None:
            lines.append("in flight: not reported (no leader's heartbeat carries it)")
        else:
            lines.append(f"in flight: {self.in_flight_records} record(s) marked, as the leaders' heartbeats report")
        if self.dead_letters is None:
            lines.append("dead letters: none (no dead-letter table)")
        else:
            lines.append(f"dead letters: {self.dead_letters} waiting")
        if self.slot is not None:
            slot = self.slot
            lines.append(
                f"log slot {slot.name}: lag {slot.lag_bytes} byte(s), retains {slot.retained_bytes} byte(s) of WAL, "
                + ("streaming to the leader" if slot.streaming else "no reader attached")
            )
        return "\n".join(lines)

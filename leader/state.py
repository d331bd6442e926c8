"""The Fast NELI state machine of one partition of the leader topic, free of I/O so that every
transition is testable on its own. The elector keeps one per partition (per shard); "partition 0"
below stands for the partition a state follows.

:class:`leader.election.NeliElector` feeds it what Kafka reports (partition 0 assigned, revoked or
lost; a heartbeat read back; an offset commit accepted) together with the current monotonic time,
and forwards the events it returns. Rules:

- Owning partition 0 makes this process leader at once, under a fresh random leader id (the "fast" in
  Fast NELI) - unless its previous term was fenced: then it waits for proof as described below.
- While it owns partition 0 the process publishes heartbeats stamped with :attr:`NeliState.heartbeat_id`.
  Only a heartbeat carrying the id of the *current* term is proof of leadership; anything else (an
  earlier term, another process) is ignored.
- No proof within ``heartbeat_timeout``: the term is fenced, exactly once. Heartbeats then carry a new
  *probe* id. After a fence, leadership returns (as a new term under the probe id, even when partition 0
  is assigned anew) only after a heartbeat with the probe id was read back *and* the group coordinator
  accepted an offset commit from this member (which it refuses from a member expelled meanwhile).
- Losing partition 0 ends the term: ``LeaderRevoked`` when handed over in an orderly rebalance,
  ``LeaderFenced`` when the assignment was lost (another member may own it already).
- Giving the term up (the owner's own work path fails): ``LeaderFenced``, and the same proof is
  needed before it leads again.
- An owner probing without proof (:meth:`NeliState.unproven`) blocks every other member, which
  cannot lead while it owns partition 0: the elector makes it leave the group after a while.
"""

from __future__ import annotations

import json
from collections.abc import Callable, Mapping
from uuid import UUID, uuid4

from leader.events import LeaderAcquired, LeaderEvent, LeaderFenced, LeaderRevoked, LeaderStatus

HEARTBEAT_FORMAT = "neli-heartbeat/1"


def encode_heartbeat(leader_id: UUID, seq: int, member: str, report: Mapping[str, float] | None = None) -> bytes:
    """The value of a heartbeat message: JSON naming the term (``leader_id``) that sent it, with the
    leader's ``report`` (such as its records in flight) for readers like ``reaper status``."""
    doc: dict[str, object] = {**(report or {})}
    doc.update(format=HEARTBEAT_FORMAT, leader_id=str(leader_id), seq=seq, member=member)
    return json.dumps(doc, separators=(",", ":")).encode()


def decode_heartbeat(value: bytes | None) -> UUID | None:
    """The leader id a heartbeat carries, or ``None`` for anything that is not a heartbeat."""
    if not value:
        return None
    try:
        doc = json.loads(value)
        if not isinstance(doc, dict) or doc.get("format") != HEARTBEAT_FORMAT:
            return None
        return UUID(str(doc["leader_id"]))
    except (ValueError, KeyError):
        return None


class NeliState:
    """One member's view of leadership. Not thread-safe: the elector serialises access."""

    def __init__(self, heartbeat_timeout: float, new_id: Callable[[], UUID] = uuid4, shard: int = 0) -> None:
        self.shard = shard  # the partition this state follows; its events carry it
        self._timeout = heartbeat_timeout
        self._new_id = new_id
        self._used: set[UUID] = set()
        self.owned = False
        self.leader_id: UUID | None = None
        self.probe_id: UUID | None = None
        self._probe_seen = False
        self._fenced = False
        self._last_proof = 0.0
        self._last_seen: float | None = None
        self._probing_since: float | None = None  # owner without a term, waiting for its probe

    def _fresh_id(self) -> UUID:
        # uuid4 does not repeat in practice; the check makes "never reused" hold even for a custom factory.
        while (candidate := self._new_id()) in self._used:
            pass
        self._used.add(candidate)
        return candidate

    @property
    def heartbeat_id(self) -> UUID | None:
        """The id to stamp on outgoing heartbeats: the term's, or the probe's when fenced; ``None`` if not owner."""
        if not self.owned:
            return None
        return self.leader_id or self.probe_id

    def assigned(self, now: float) -> LeaderEvent | None:
        """Partition 0 was assigned to this member."""
        if self.owned:
            return None
        self.owned = True
        self._last_seen = None
        if self._fenced:
            self.probe_id, self._probe_seen = self._fresh_id(), False
            self._probing_since = now
            return None
        return self._begin_term(self._fresh_id(), now)

    def released(self, lost: bool) -> LeaderEvent | None:
        """Partition 0 was revoked (``lost=False``) or lost (``lost=True``), or the elector is closing."""
        self.owned = False
        self.probe_id, self._probe_seen = None, False
        self._last_seen = self._probing_since = None
        term, self.leader_id = self.leader_id, None
        if term is None:
            return None
        self._fenced = lost
        return LeaderFenced(term, self.shard) if lost else LeaderRevoked(term, self.shard)

    def heartbeat(self, sender: UUID, now: float) -> bool:
        """A heartbeat stamped ``sender`` was read back.

        Returns ``True`` when it is this member's probe heartbeat after a fence: leadership may resume
        once the coordinator confirms membership (see :meth:`confirmed`).
        """
        if not self.owned:
            return False
        if self.leader_id is not None and sender == self.leader_id:
            self._last_proof = now
            self._last_seen = now
            return False
        if self.leader_id is None and sender == self.probe_id:
            self._last_seen = now
            self._probe_seen = True
            return True
        return False

    def confirmed(self, probe: UUID, now: float) -> LeaderEvent | None:
        """The coordinator accepted a commit issued after reading the heartbeat of ``probe``."""
        if not self.owned or self.leader_id is not None or probe != self.probe_id or not self._probe_seen:
            return None
        self.probe_id, self._probe_seen = None, False
        return self._begin_term(probe, now)

    def tick(self, now: float) -> LeaderEvent | None:
        """Check the heartbeat deadline; fence the term once when it has passed."""
        if self.leader_id is None or now - self._last_proof <= self._timeout:
            return None
        term, self.leader_id = self.leader_id, None
        self.probe_id, self._probe_seen = self._fresh_id(), False
        self._fenced, self._probing_since = True, now
        return LeaderFenced(term, self.shard)

    def unproven(self, now: float) -> float:
        """Seconds this owner has been probing without proof since its fence or its assignment
        (0 when it leads or owns nothing)."""
        if not self.owned or self.leader_id is not None or self._probing_since is None:
            return 0.0
        return now - self._probing_since

    def give_up(self) -> LeaderEvent | None:
        """The member steps down on its own (its work path fails; the elector leaves the group): the
        term is fenced as on a missed deadline, and a later assignment needs the same proof."""
        if self.leader_id is None:
            return None
        term, self.leader_id = self.leader_id, None
        self._fenced = True
        return LeaderFenced(term, self.shard)

    def status(self, now: float) -> LeaderStatus:
        """A snapshot; leadership already reads as lost once the deadline passed, before :meth:`tick` runs."""
        leading = self.leader_id is not None and now - self._last_proof <= self._timeout
        since = None if self._last_seen is None else max(0.0, now - self._last_seen)
        return LeaderStatus(
            is_leader=leading, leader_id=self.leader_id if leading else None, seconds_since_heartbeat=since
        )

    def _begin_term(self, leader_id: UUID, now: float) -> LeaderAcquired:
        self.leader_id, self._fenced, self._probing_since = leader_id, False, None
        # The assignment (or the confirmed probe) is itself proof; the deadline runs from here.
        self._last_proof = now
        return LeaderAcquired(leader_id, self.shard)

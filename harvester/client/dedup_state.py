"""The de-duplication rule without a Kafka client: :class:`DedupState` remembers which record
identities were read and tells a re-delivery from a new record. :class:`harvester.client.dedup.DedupReader`
applies it to a confluent-kafka consumer; other readers call it directly."""

from __future__ import annotations

import base64
from collections import OrderedDict
from collections.abc import Callable, Mapping
from dataclasses import dataclass, field
from typing import Any

from harvester.core.identity import KEY_RUN, Identity

DEFAULT_CAPACITY = 100_000
DEFAULT_DEPTH = KEY_RUN  # a leader's run of a key's records sent and not purged
DEFAULT_TERMS = 4
_STATE_VERSION = 3
_STATE_VERSIONS = (1, 2, 3)  # version 1 had no batch chains, version 2 no recent ids

StreamKey = tuple[str, str, bytes | None]
"""(producer, topic, message key): the unit within which the harvester orders records."""


@dataclass(slots=True)
class _Term:
    first: list[int] = field(default_factory=list)
    stack: list[int] = field(default_factory=list)
    recent: list[int] = field(default_factory=list)  # least recently read first


@dataclass(slots=True)
class _Chain:
    """A key's latest Spark micro-batch: every record of the key in it up to ``high`` was read
    (None: its first record was not, so nothing is known)."""

    epoch: int
    batch: int
    high: int | None


class DedupState:
    """The bounded memory of record identities seen.

    ``capacity`` bounds the keys remembered (least recently read first out), ``terms`` the epochs
    per key, ``depth`` the ids per epoch (below, why these bounds suffice). ``on_evict`` is told
    the reason (``key``, ``term`` or ``depth``) whenever state is dropped to keep them. Not
    thread-safe: one reader thread owns it.

    Only an exact match of an id already seen is a re-delivery: outbox ids are unique per producer,
    so remembering more ids never drops a new record, it only catches more duplicates. "Drop if
    id <= highest seen" would be wrong: ids are taken at insert time and become visible at commit,
    so two transactions writing the same key can publish id 11 before id 10.

    What is remembered, per (producer, topic, key) and per epoch (leadership term) of that key:

    * ``stack``: the ids of that term, most recent last, that no higher id of the same term has
      followed yet (a strictly decreasing list; at most ``depth`` long);
    * ``first``: the first ``depth`` distinct ids the term published in that key;
    * ``recent``: the last ``depth`` distinct ids the term published in that key, in read order (a
      window: the id read least recently leaves it, which is not an eviction).

    Why this catches every duplicate the harvester produces (engine facts, see
    :mod:`harvester.core.engine`): with mark-purge/reset and ``keyRelease: purged`` (goharvest's
    barrier), per key at most one record is in flight, and a key's next record is sent only after the
    previous one was acknowledged and purged; by default (``keyRelease: acknowledged``, always with
    the log source), a key has at
    most :data:`~harvester.core.identity.KEY_RUN` (``DEFAULT_DEPTH``) records sent and not deleted
    yet, several in flight at once, which Kafka writes in the order sent, and deletes commit in
    acknowledgement order.

    1. A live re-publication of X (a remark after a failed delivery, or a new leader re-publishing
       what the old one did not delete). A new term re-publishes a key's records sent and not
       deleted (a run of at most ``KEY_RUN``) in the order they were sent, so each is among the
       ``recent`` ids (or on the stack) of the term that sent its previous copy: that term sent
       nothing of the key after them. With ``keyRelease: purged`` that is X alone, the
       key's last record sent, and a remark or a new term marks in id order: X's new copy follows,
       since its previous one, only lower ids of the key (anything higher waits behind X), however
       many, so X is still on the stack of the term that sent the previous copy.
    2. A fenced zombie can still hold X in librdkafka's queue and deliver it late, after newer terms'
       records of the key (only what it had in flight: a run of at most ``KEY_RUN`` per key per zombie
       term, one record with ``keyRelease: purged``). Its earlier copy was sent
       either by the zombie's own term (X is among that term's ``recent`` ids or on its stack, by 1.)
       or by the first later term that published it, which sent X after only the run before it and
       the lower, late-committed ids of the key: X is among that term's ``first`` ids when those
       together are fewer than ``depth``.

    The Spark drain (``readStream.format("outbox")``) publishes a whole micro-batch at once, many
    records of a key in flight, and a failed batch is replayed with its epoch, ids and order: 1. does
    not hold, so its copies carry the batch number and the id of the key's record before them in the
    batch (``previous``, absent for the key's first). Per key, the state keeps the latest (epoch,
    batch) and ``high``, the end of the chain of that batch's records it read from the key's first
    one on, each link checked by ``previous``: every record of the key in that batch up to ``high``
    was read, so a copy of the same (epoch, batch) with an id at or below ``high`` is a re-delivery.
    (A record between two links of one attempt that an earlier attempt held was deleted in between,
    that is purged by a newer term, which published it.) A copy whose ``previous`` is not ``high`` (a
    record before it was lost with a failed attempt) leaves the chain as it is: ids are never dropped
    on a guess.

    So the state suffices when a key's late-committed lower ids pending at once and its records sent
    and not deleted (a leader's run, at most ``DEFAULT_DEPTH``) are together at most
    ``depth``, the zombie terms still to be heard from are among the key's ``terms`` most recent
    epochs, and the key stays among the ``capacity`` most recently read keys until its re-delivery
    arrives. State dropped to keep those bounds is counted by ``harvester_dedup_state_evictions``.
    """

    def __init__(
        self,
        *,
        capacity: int = DEFAULT_CAPACITY,
        depth: int = DEFAULT_DEPTH,
        terms: int = DEFAULT_TERMS,
        on_evict: Callable[[str], None] | None = None,
    ) -> None:
        if capacity < 1 or depth < 1 or terms < 1:
            raise ValueError("capacity, depth and terms must be at least 1")
        self.capacity = capacity
        self.depth = depth
        self.terms = terms
        self._on_evict = on_evict
        self._keys: OrderedDict[StreamKey, dict[int, _Term]] = OrderedDict()
        self._chains: dict[StreamKey, _Chain] = {}  # keys whose latest record came from the Spark drain

    def __len__(self) -> int:
        return len(self._keys)

    def observe(self, stream: StreamKey, identity: Identity) -> bool:
        """Record one copy of ``identity`` read in ``stream``; True if it re-delivers a remembered id."""
        terms = self._keys.get(stream)
        if terms is None:
            terms = self._keys[stream] = {}
            if len(self._keys) > self.capacity:
                evicted, _ = self._keys.popitem(last=False)
                self._chains.pop(evicted, None)
                self._evicted("key")
        else:
            self._keys.move_to_end(stream)
        rid = identity.id
        duplicate = any(rid in t.stack or rid in t.first or rid in t.recent for t in terms.values())
        if identity.batch is not None:
            duplicate = self._chained(stream, identity) or duplicate
        term = terms.get(identity.epoch)
        if term is None:
            term = terms[identity.epoch] = _Term()
            if len(terms) > self.terms:
                del terms[min(terms)]
                self._evicted("term")
        self._remember(term, rid)
        return duplicate

    def _chained(self, stream: StreamKey, identity: Identity) -> bool:
        """Follow the key's chain in its micro-batch; True if the copy is at or below its end."""
        assert identity.batch is not None
        chain = self._chains.get(stream)
        if chain is None or (chain.epoch, chain.batch) != (identity.epoch, identity.batch):
            start = identity.id if identity.previous is None else None
            self._chains[stream] = _Chain(identity.epoch, identity.batch, start)
            return False
        if chain.high is not None and identity.id <= chain.high:
            return True
        if chain.high is not None and identity.previous == chain.high:
            chain.high = identity.id
        return False

    def _remember(self, term: _Term, rid: int) -> None:
        if len(term.first) < self.depth and rid not in term.first:
            term.first.append(rid)
        recent = term.recent
        # Ordered by the latest copy: what the term sent after that copy is what bounds point 1.
        if rid in recent:
            recent.remove(rid)
        recent.append(rid)
        if len(recent) > self.depth:
            del recent[0]
        stack = term.stack
        # A higher id of the same term means every lower one before it was purged when one record of
        # a key goes out at a time (``keyRelease: purged``): never re-sent live then. Runs of several
        # in flight are what ``recent`` is for.
        while stack and stack[-1] < rid:
            stack.pop()
        if not stack or stack[-1] != rid:
            stack.append(rid)
            if len(stack) > self.depth:
                del stack[0]
                self._evicted("depth")

    def _evicted(self, reason: str) -> None:
        if self._on_evict is not None:
            self._on_evict(reason)

    def snapshot(self) -> dict[str, Any]:
        """The state as a compact JSON-compatible dict (keys in least-recently-read order)."""
        producers: dict[str, int] = {}
        topics: dict[str, int] = {}
        entries: list[list[Any]] = []
        for stream, terms in self._keys.items():
            producer, topic, key = stream
            entry: list[Any] = [
                producers.setdefault(producer, len(producers)),
                topics.setdefault(topic, len(topics)),
                None if key is None else base64.b64encode(key).decode("ascii"),
                [[epoch, list(t.first), list(t.stack), list(t.recent)] for epoch, t in terms.items()],
            ]
            chain = self._chains.get(stream)
            if chain is not None:
                entry.append([chain.epoch, chain.batch, chain.high])
            entries.append(entry)
        return {"version": _STATE_VERSION, "producers": list(producers), "topics": list(topics), "keys": entries}

    def restore(self, snapshot: Mapping[str, Any]) -> None:
        """Replace the state with a :meth:`snapshot`; bounds smaller than the saved ones trim it."""
        if snapshot.get("version") not in _STATE_VERSIONS:
            raise ValueError(f"unsupported dedup state version {snapshot.get('version')!r}")
        producers: list[str] = list(snapshot["producers"])
        topics: list[str] = list(snapshot["topics"])
        restored: OrderedDict[StreamKey, dict[int, _Term]] = OrderedDict()
        chains: dict[StreamKey, _Chain] = {}
        for pi, ti, key, terms, *chain in snapshot["keys"]:
            stream = (producers[pi], topics[ti], None if key is None else base64.b64decode(key))
            if chain:
                epoch, batch, high = chain[0]
                chains[stream] = _Chain(int(epoch), int(batch), None if high is None else int(high))
            kept = sorted(terms, key=lambda t: int(t[0]))[-self.terms :]
            restored[stream] = {int(t[0]): self._term(*t[1:]) for t in kept}
        while len(restored) > self.capacity:
            restored.popitem(last=False)
        self._keys = restored
        self._chains = {stream: chain for stream, chain in chains.items() if stream in restored}

    def _term(self, first: list[Any], stack: list[Any], recent: list[Any] | None = None) -> _Term:
        """A saved term within this state's ``depth`` (versions before 3 saved no recent ids)."""
        return _Term(
            [int(i) for i in first][: self.depth],
            [int(i) for i in stack][-self.depth :],
            [int(i) for i in recent or ()][-self.depth :],
        )

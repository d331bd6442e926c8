"""A model of what the harvester's engine writes to one partition, duplicates included.

It follows the MP/R rules of :mod:`harvester.core.engine` for a handful of keys: ids are taken at insert
and become visible at commit (so a key's ids can be published out of id order); a leader marks
visible, unpurged records in id order into per-key FIFOs; at most one record per key is in flight;
a key's next record is sent only after the previous one was acknowledged and purged. Faults:

* ``fail_landed`` / ``fail_lost``: a delivery reported failed (that did or did not reach Kafka) is
  reset and forces a remark: FIFOs are discarded and everything unpurged is marked again;
* ``crash_landed`` / ``crash_lost``: the leader dies with the record delivered (not purged) or
  not; a new term (epoch) re-marks everything unpurged;
* ``zombie``: the leader is fenced with the record still in librdkafka's queue; that copy lands
  later (``stale``, or at the end), after newer terms' records of its key.

The output is the sequence of copies that reached the partition: ``(key, id, epoch)``.
"""

from __future__ import annotations

import random
from collections.abc import Callable
from dataclasses import dataclass, field

Copy = tuple[str, int, int]
"""(key, outbox id, epoch) of one message in the partition."""

# Weighted: mostly progress, now and then a fault.
ACTIONS = (
    *["insert"] * 4,
    *["commit"] * 4,
    *["mark"] * 3,
    *["send"] * 4,
    *["ack"] * 4,
    "fail_landed",
    "fail_lost",
    "crash_landed",
    "crash_lost",
    "zombie",
    "stale",
)


@dataclass
class Outbox:
    """The engine's view of the outbox and of its own per-key queues."""

    keys: list[str]
    max_pending: int
    max_epochs: int
    epoch: int = 1
    next_id: int = 1
    pending: dict[int, str] = field(default_factory=dict)  # inserted, not committed
    unpurged: dict[int, str] = field(default_factory=dict)  # committed, not purged
    marked: set[int] = field(default_factory=set)  # marked under the current leader id
    fifo: dict[str, list[int]] = field(default_factory=dict)
    in_flight: dict[str, int] = field(default_factory=dict)
    zombies: list[Copy] = field(default_factory=list)  # copies stuck in fenced leaders' queues
    out: list[Copy] = field(default_factory=list)

    def step(self, action: str, pick: Callable[[int], int]) -> None:
        """Apply one action; ``pick(n)`` chooses among ``n`` candidates (key, record, ...)."""
        sendable = [k for k in self.keys if k not in self.in_flight and self.fifo.get(k)]
        busy = sorted(self.in_flight)
        if action == "insert" and len(self.pending) < self.max_pending:
            self.pending[self.next_id] = self.keys[pick(len(self.keys))]
            self.next_id += 1
        elif action == "commit" and self.pending:
            rid = sorted(self.pending)[pick(len(self.pending))]
            self.unpurged[rid] = self.pending.pop(rid)
        elif action == "mark":
            for rid in sorted(set(self.unpurged) - self.marked):
                self.marked.add(rid)
                self.fifo.setdefault(self.unpurged[rid], []).append(rid)
        elif action == "send" and sendable:
            key = sendable[pick(len(sendable))]
            self.in_flight[key] = self.fifo[key].pop(0)
        elif action == "stale" and self.zombies:
            self.out.append(self.zombies.pop(pick(len(self.zombies))))
        elif action not in ("insert", "commit", "mark", "send", "stale") and busy:
            self._complete(action, busy[pick(len(busy))])

    def _complete(self, action: str, key: str) -> None:
        rid = self.in_flight[key]
        if action in ("ack", "fail_landed", "crash_landed"):
            self.out.append((key, rid, self.epoch))
        if action == "ack":
            del self.in_flight[key]
            del self.unpurged[rid]
            self.fifo[key] = [r for r in self.fifo.get(key, []) if r != rid]  # a re-marked copy waiting behind it
        elif action in ("fail_landed", "fail_lost"):
            # Reset and forced remark: the key FIFOs are discarded; other keys' records stay in flight.
            del self.in_flight[key]
            self.marked.clear()
            self.fifo.clear()
        elif action in ("crash_landed", "crash_lost", "zombie") and self.epoch < self.max_epochs:
            if action == "zombie":
                # Fenced with these still queued in librdkafka: each lands later, after newer records.
                self.zombies.extend((k, r, self.epoch) for k, r in self.in_flight.items())
            self.epoch += 1
            self.marked.clear()
            self.fifo.clear()
            self.in_flight.clear()

    def finish(self) -> list[Copy]:
        """Stale copies still queued land at the end; return everything that reached the partition."""
        self.out.extend(self.zombies)
        self.zombies.clear()
        return self.out


def first_copies(stream: list[Copy]) -> list[Copy]:
    """What an exactly-once reader must yield: each record's first copy, in stream order."""
    seen: set[int] = set()
    out: list[Copy] = []
    for copy in stream:
        if copy[1] not in seen:
            seen.add(copy[1])
            out.append(copy)
    return out


def run(script: list[tuple[str, int]], keys: int, max_pending: int = 3, max_epochs: int = 4) -> list[Copy]:
    """The partition's contents after ``script``: (action, choice) steps, ``choice`` picking among
    the candidates of the step (modulo their number), so that Hypothesis can shrink it."""
    box = Outbox([f"k{i}" for i in range(keys)], max_pending, max_epochs)
    for action, choice in script:
        box.step(action, _modulo(choice))
    return box.finish()


def _modulo(choice: int) -> Callable[[int], int]:
    """A ``pick`` for :meth:`Outbox.step`: candidate number ``choice`` modulo their number."""
    return lambda n: choice % n


def random_stream(seed: int, keys: int, steps: int, max_pending: int = 3, max_epochs: int = 4) -> list[Copy]:
    """A reproducible harvester-shaped stream with every kind of duplicate."""
    rng = random.Random(seed)
    return run([(rng.choice(ACTIONS), rng.randrange(1 << 16)) for _ in range(steps)], keys, max_pending, max_epochs)

"""The shards a drain harvests and the term it harvests each under, on the driver.

Without a leader group (no ``kafka.bootstrap.servers`` option) the query takes every shard's term
at its first plan: for an outbox that only this query drains. With one, it joins the reapers' NELI
group (:mod:`leader`, one election per partition of the leader topic, as ``reaper run`` does) and
harvests only the shards whose partition it owns, so a reaper and a Spark drain never harvest one
shard at once:

- ``LeaderAcquired``: the next plan bumps the shard's fence epoch under the elector's leader id
  (the term start a reaper makes) and plans the shard from then on.
- ``LeaderRevoked``: planning leaves the shard at once, and the handler (the partition is released
  when it returns) waits until the shard's last planned batch was committed, that is delivered and
  purged, bounded by :data:`REVOKE_WAIT`. So the new owner's first mark comes after this query's
  last delivery of the shard. Meanwhile the elector keeps the other shards' terms proven
  (:mod:`leader.hold`).
- ``LeaderFenced`` (heartbeats lost): planning leaves the shard at once; a batch in flight still
  completes, and its purge is refused by the fence once the new owner took its term: its records
  are marked again by the new owner (at least once, with identity headers).
"""

from __future__ import annotations

import os
import socket
import threading
import time
import uuid
from dataclasses import dataclass
from functools import partial

import psycopg
from psycopg import sql

from harvester.core.identity import IdentityHeaders
from harvester.core.protocols import FencedError, ShardCountError
from harvester.postgres.schema.migrations import fence_table
from harvester.postgres.table.store import PostgresStore
from harvester.spark.drain.options import DrainConfigError, DrainOptions
from harvester.spark.retry import retrying
from leader import ElectorConfig, LeaderAcquired, LeaderEvent, LeaderRevoked, NeliElector

REVOKE_WAIT = 60.0
"""Seconds a revoked shard's partition is held for the shard's batch in flight to be committed (a
reaper waits its ``drainInterval``, one minute by default)."""


@dataclass(slots=True)
class _Shard:
    leader_id: uuid.UUID | None = None  # the term the query holds now (None: not led)
    started: uuid.UUID | None = None  # the term whose fence epoch the shard's store runs under
    outstanding: int | None = None  # the last batch planned under this driver, not yet committed


class Shards:
    """One store per shard, each under a term of its own, and the election that grants them."""

    def __init__(self, options: DrainOptions) -> None:
        first = PostgresStore(
            options.dsn,
            options.table,
            application_name="outbox-harvester-spark",
            identity=IdentityHeaders(options.header_prefix),
            producer_name=options.producer_name,
            shards=options.shards,
        )
        try:
            self.value_kind = first.prepare().limits.value_kind
        except ShardCountError as exc:
            first.close()
            raise DrainConfigError(_mismatch(options)) from exc
        except BaseException:
            first.close()
            raise
        self.options = options
        self.stores = (first, *(first.sibling(i) for i in range(1, options.shards)))
        self.producer = first.producer
        self._cond = threading.Condition()
        self._closing = False
        self._state = [_Shard() for _ in self.stores]
        self._elector: NeliElector | None = None
        if not options.elected:
            everything = uuid.uuid4()
            for state in self._state:
                state.leader_id = everything
            return
        self._elector = NeliElector(
            ElectorConfig(
                kafka_config=dict(options.kafka),
                group_id=options.group_id,
                topic=options.leader_topic,
                name=f"spark-{socket.gethostname()}-{os.getpid()}",
                partitions=options.shards,
            )
        )
        try:
            self._elector.start(self._on_event)
        except BaseException:
            self.close()
            raise

    # ------------------------------------------------------------------ the election's thread

    def _on_event(self, event: LeaderEvent) -> None:
        with self._cond:
            state = self._state[event.shard]
            if isinstance(event, LeaderAcquired):
                state.leader_id = event.leader_id
                self._cond.notify_all()
                return
            state.leader_id = None  # revoked or fenced: plan the shard no more
            if not isinstance(event, LeaderRevoked):
                return  # fenced: must not block
            deadline = time.monotonic() + REVOKE_WAIT
            while state.outstanding is not None and not self._closing:
                left = deadline - time.monotonic()
                if left <= 0:
                    break
                self._cond.wait(left)

    # ------------------------------------------------------------------ the driver's thread

    def wait_for_any(self, timeout: float) -> None:
        """Block until the query leads some shard, or ``timeout`` passed (``Trigger.AvailableNow``
        plans once, at its start, what the query leads)."""
        deadline = time.monotonic() + timeout
        with self._cond:
            while not any(s.leader_id for s in self._state) and (left := deadline - time.monotonic()) > 0:
                self._cond.wait(left)

    def lead(self) -> list[int]:
        """The shards to plan now, each one's term started (its fence epoch bumped) first."""
        with self._cond:
            granted = [(shard, s.leader_id) for shard, s in enumerate(self._state) if s.leader_id is not None]
        led: list[int] = []
        for shard, leader_id in granted:
            if self._state[shard].started != leader_id:
                assert leader_id is not None
                try:
                    retrying(partial(self.stores[shard].acquire, leader_id))
                except ShardCountError as exc:
                    raise DrainConfigError(_mismatch(self.options)) from exc
                self._state[shard].started = leader_id
            led.append(shard)
        return led

    def term(self, shard: int) -> uuid.UUID:
        """The leader id of ``shard``'s term (started by :meth:`lead`), which dead letters record."""
        started = self._state[shard].started
        assert started is not None
        return started

    def deliverable(self, shard: int, batch: int) -> bool:
        """Whether this driver may deliver batch ``batch`` of ``shard``: one it planned, or a replay
        (after a restart) of a shard it leads now; else the records stay for the shard's leader."""
        with self._cond:
            if self._state[shard].outstanding == batch:
                return True
        if shard not in self.lead():
            return False
        self.planned(shard, batch)
        return True

    def planned(self, shard: int, batch: int) -> None:
        """Batch ``batch`` has records of ``shard``: a revocation waits for its commit."""
        with self._cond:
            self._state[shard].outstanding = batch

    def committed(self, shard: int, batch: int) -> None:
        """Batch ``batch`` of ``shard`` was committed (delivered, and purged or left to a newer term)."""
        with self._cond:
            state = self._state[shard]
            if state.outstanding is not None and state.outstanding <= batch:
                state.outstanding = None
                self._cond.notify_all()

    def fenced(self, shard: int, error: FencedError) -> None:
        """A newer term took ``shard``'s fence. Without a leader group that is a second copy of the
        query (or a reaper): raise. In the group, as a reaper's engine does: if the elector still
        says this query leads the shard, the fence came from a stale holder and the next plan takes
        it back; else the shard's new owner has it."""
        if self._elector is None:
            raise error
        leading = self._elector.status_of(shard).is_leader
        with self._cond:
            state = self._state[shard]
            state.started = None
            if not leading:
                state.leader_id = None

    def close(self) -> None:
        """Leave the group (a revocation then waits for nothing) and close the connections."""
        with self._cond:
            self._closing = True
            self._cond.notify_all()
        if self._elector is not None:
            self._elector.close()
            self._elector = None
        for store in self.stores:
            store.close()


def _mismatch(options: DrainOptions) -> str:
    """The one-line refusal of a query whose ``shards`` is not the number the fence rows record."""
    fence = fence_table(options.table)
    query = sql.SQL("SELECT DISTINCT shards FROM {} WHERE outbox_table = %s ORDER BY 1").format(fence.ident)
    with psycopg.connect(options.dsn) as conn:
        found = [str(r[0]) for r in conn.execute(query, (options.table.qualified,))]
    recorded = " or ".join(n for n in found if n != str(options.shards)) or "another number of"
    return (
        f"option shards is {options.shards} but {options.table.qualified} is harvested with {recorded} shards: "
        "use the number its reapers use (to change it, see docs/sharding.md)"
    )

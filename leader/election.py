"""Fast NELI leader election over a Kafka consumer group.

Every competing process subscribes a consumer to the leader topic under the same group id; the member
that owns partition 0 leads. The owner also publishes heartbeats to partition 0 and reads them back, so
it notices within ``heartbeat_timeout`` when it may have been cut off, without waiting for the group
protocol. See :mod:`leader.state` for the rules and ``docs/leader.md`` for tuning failover time.

With ``partitions`` > 1 (sharded harvesting) each partition ``i`` is an election of its own: its owner
leads shard ``i``, heartbeats to partition ``i`` and reads them back, and is fenced and hands over per
partition. The group coordinator spreads the partitions over the members (cooperative-sticky: a member
joining or leaving moves as few as it can).
"""

from __future__ import annotations

import threading
import time
from collections.abc import Callable, Mapping
from uuid import UUID

import structlog
from confluent_kafka import OFFSET_END, Consumer, KafkaError, KafkaException, Message, Producer, TopicPartition
from confluent_kafka.admin import AdminClient

from leader.clients import common_config, consumer_config, producer_config
from leader.config import ElectorConfig
from leader.events import LeaderEvent, LeaderRevoked, LeaderStatus
from leader.hold import hold
from leader.members import group_members
from leader.state import NeliState, decode_heartbeat, encode_heartbeat
from leader.topic import ensure_leader_topic

log = structlog.get_logger("leader")


class NeliElector:
    """Competes for leadership of ``config.group_id``; implements :class:`harvester.core.protocols.Elector`.

    A background thread owns the consumer: it polls at most every ``min_poll_interval`` and delivers
    events to the listener. ``LeaderRevoked`` handlers may block (partition 0 is released after they
    return, but no longer than ``max_poll_interval``); ``LeaderFenced`` handlers must return at once.
    """

    def __init__(
        self,
        config: ElectorConfig,
        *,
        clock: Callable[[], float] = time.monotonic,
        report: Callable[[int], Mapping[str, float]] | None = None,
        healthy: Callable[[], bool] | None = None,
    ) -> None:
        self._config = config
        self._clock = clock
        self._report = report  # fields a partition's heartbeats carry (its leader's records in flight)
        # False while the leader's own work path fails (the harvester's database): it steps down.
        self._healthy = healthy
        self._rejoin_at: float | None = None  # when a member that stepped down subscribes again
        self._peers_checked = float("-inf")  # when the group was last looked up for a member to yield to
        self._stayed = False  # leader_stays was logged for the current failure (once per failure)
        self._admin: AdminClient | None = None
        self._lock = threading.Lock()
        self._states = [NeliState(config.heartbeat_timeout, shard=p) for p in range(config.partitions)]
        self._stopping = threading.Event()
        self._thread: threading.Thread | None = None
        self._on_event: Callable[[LeaderEvent], None] = lambda _: None
        self._consumer: Consumer | None = None
        self._producer: Producer | None = None
        # Per partition: the id of the last heartbeat sent and when the next is due, and the probe
        # whose membership commit is awaited.
        self._beat_id: list[UUID | None] = [None] * config.partitions
        self._next_beat = [0.0] * config.partitions
        self._seq = 0
        self._confirming: list[UUID | None] = [None] * config.partitions

    @property
    def config(self) -> ElectorConfig:
        """The configuration this elector runs with."""
        return self._config

    @property
    def status(self) -> LeaderStatus:
        """Current view of partition 0; ``is_leader`` turns false as soon as the heartbeat deadline passes."""
        return self.status_of(0)

    def status_of(self, shard: int) -> LeaderStatus:
        """Current view of partition ``shard``, as :attr:`status` gives partition 0's."""
        with self._lock:
            return self._states[shard].status(self._clock())

    @property
    def running(self) -> bool:
        """Whether the election thread runs: False before :meth:`start`, after :meth:`close`, and
        after an unexpected error ended it."""
        return self._thread is not None and self._thread.is_alive()

    def start(self, on_event: Callable[[LeaderEvent], None]) -> None:
        """Ensure the leader topic exists, join the group and start the election thread.

        Raises :class:`leader.topic.LeaderTopicError` when the topic is absent and cannot be created.
        """
        if self._thread is not None:
            raise RuntimeError("elector already started")
        ensure_leader_topic(self._config, common_config(self._config))
        self._on_event = on_event
        self._consumer = Consumer(consumer_config(self._config, self._on_commit))
        self._producer = Producer(producer_config(self._config))
        self._subscribe()
        self._thread = threading.Thread(target=self._run, name=f"neli-{self._config.group_id}", daemon=True)
        self._thread.start()

    def close(self, timeout: float | None = None) -> None:
        """Emit ``LeaderRevoked`` if leader, then leave the group at once so a standby takes over.

        Waits at most ``timeout`` seconds (None: until left): leaving can wait for a pending group
        request up to the rebalance timeout, minutes, and a caller stopping within a deadline goes
        on meanwhile; the election thread then leaves in the background. Called from an event
        handler (the elector's own thread), it returns at once and the election thread stops after
        the handler returns.
        """
        self._stopping.set()
        thread = self._thread
        if thread is not None and thread is not threading.current_thread():
            thread.join(timeout)
            if thread.is_alive():
                log.warning("leader_close_timeout", group=self._config.group_id, timeout_seconds=timeout)

    # -- election thread -----------------------------------------------------------------------------

    def _run(self) -> None:
        interval = self._config.min_poll_interval
        try:
            while not self._stopping.is_set():
                began = self._clock()
                try:
                    self._pulse()
                except KafkaException as e:
                    log.error("election_poll_failed", error=str(e.args[0]))
                self._stopping.wait(max(0.0, interval - (self._clock() - began)))
        finally:
            self._shutdown()

    def _pulse(self) -> None:
        assert self._consumer is not None and self._producer is not None
        # The deadline comes first: a process resuming from a freeze fences itself before anything else.
        for state in self._states:
            with self._lock:
                event = state.tick(self._clock())
            self._emit(event)
        self._step_down_or_rejoin()
        for partition in range(len(self._states)):
            self._beat(partition)
        for message in self._consumer.consume(self._config.poll_batch, 0):
            self._read(message)
        self._producer.poll(0)

    def _step_down_or_rejoin(self) -> None:
        """Leave the group so that another member takes the partitions over, provided the group has
        another member (alone, this one keeps trying: yielding to nobody only delays its own
        retries), when this member leads and its work path fails (``healthy`` says so: its terms are
        fenced first), or when it has owned a partition without proof of its heartbeats for twice the
        heartbeat timeout (its path to the leader topic fails while the coordinator still counts it
        in: nobody else could lead meanwhile). It subscribes again after ``session_timeout``, when
        the others have rebalanced (the sticky assignor then leaves the partitions where they are)."""
        assert self._consumer is not None
        now = self._clock()
        if self._rejoin_at is not None:
            if now >= self._rejoin_at:
                self._rejoin_at = None
                self._subscribe()
            return
        if now - self._peers_checked < self._config.heartbeat_timeout:
            return
        reason = self._why_step_down(now)
        if reason is None:
            return
        self._peers_checked = now
        if not self._others_in_group():
            if not self._stayed:
                log.info("leader_stays", member=self._config.name, reason=f"{reason}, but no other member")
                self._stayed = True
            return
        log.warning("leader_stepping_down", member=self._config.name, reason=reason)
        for state in self._states:
            with self._lock:
                event = state.give_up()
            self._emit(event)
        self._consumer.unsubscribe()
        self._rejoin_at = self._clock() + self._config.session_timeout

    def _why_step_down(self, now: float) -> str | None:
        """Why this member should leave the group now, if it should."""
        limit = 2 * self._config.heartbeat_timeout
        with self._lock:
            leading = any(state.leader_id is not None for state in self._states)
            stuck = any(state.unproven(now) > limit for state in self._states)
        if stuck:
            return "no proof of its heartbeats while it owns the leader partition"
        if not leading or self._healthy is None:
            return None
        try:
            if self._healthy():
                self._stayed = False
                return None
        except Exception:  # a broken check must not end the election thread
            log.exception("leader_health_check_failed")
            return None
        return "its work path fails"

    def _others_in_group(self) -> bool:
        """Whether the group has a member besides this one (True when that cannot be told)."""
        if self._admin is None:
            self._admin = AdminClient(common_config(self._config))
        try:
            members = group_members(self._admin, self._config.group_id, self._config.heartbeat_interval)
        except Exception as exc:  # a lookup that fails says nothing: yield, as the check asked
            log.info("leader_group_lookup_failed", error=str(exc))
            return True
        # This member is in the group: none found means the lookup missed the group (its coordinator
        # still loading, say), which says nothing either.
        return members != 1

    def _subscribe(self) -> None:
        assert self._consumer is not None
        self._consumer.subscribe(
            [self._config.topic], on_assign=self._on_assign, on_revoke=self._on_revoke, on_lost=self._on_lost
        )

    def _beat(self, partition: int) -> None:
        assert self._producer is not None
        now = self._clock()
        with self._lock:
            beat_id = self._states[partition].heartbeat_id
        if beat_id is None:
            self._beat_id[partition] = None
            return
        if beat_id == self._beat_id[partition] and now < self._next_beat[partition]:
            return
        self._seq += 1
        try:
            self._producer.produce(
                self._config.topic,
                partition=partition,
                value=encode_heartbeat(
                    beat_id, self._seq, self._config.name, self._report(partition) if self._report else None
                ),
            )
        except (BufferError, KafkaException) as e:
            log.warning("heartbeat_not_enqueued", error=str(e), shard=partition)
            return
        self._beat_id[partition], self._next_beat[partition] = beat_id, now + self._config.heartbeat_interval

    def _read(self, message: Message) -> None:
        assert self._consumer is not None
        err = message.error()
        if err is not None:
            if err.code() != KafkaError._PARTITION_EOF:
                log.warning("leader_topic_consumer_error", error=str(err))
            return
        partition = message.partition()
        owned = partition is not None and 0 <= partition < len(self._states)
        sender = decode_heartbeat(message.value()) if owned else None
        if sender is None or partition is None:
            return
        with self._lock:
            probe = self._states[partition].heartbeat(sender, self._clock())
        if not probe:
            return
        # Reading the probe back shows the cluster is reachable; a commit shows the coordinator still
        # counts this member in the generation that owns the partition (an expelled zombie is refused).
        self._confirming[partition] = sender
        offset = message.offset()
        assert offset is not None
        try:
            self._consumer.commit(
                offsets=[TopicPartition(self._config.topic, partition, offset + 1)], asynchronous=True
            )
        except KafkaException as e:
            log.info("membership_unconfirmed", error=str(e.args[0]), shard=partition)

    def _on_commit(self, err: KafkaError | None, partitions: list[TopicPartition]) -> None:
        for committed in partitions:
            p = committed.partition
            probe = self._confirming[p] if 0 <= p < len(self._states) else None
            if probe is None:
                continue
            failure = err or committed.error
            if failure is not None:
                log.info("membership_unconfirmed", error=str(failure), shard=p)
                continue
            with self._lock:
                event = self._states[p].confirmed(probe, self._clock())
            if event is not None:
                self._confirming[p] = None
            self._emit(event)

    def _on_assign(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        # Earlier heartbeats prove nothing for this term: start reading at the end.
        consumer.incremental_assign([TopicPartition(p.topic, p.partition, OFFSET_END) for p in partitions])
        for p in sorted(p.partition for p in partitions if p.partition < len(self._states)):
            with self._lock:
                event = self._states[p].assigned(self._clock())
            self._emit(event)

    def _on_revoke(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._released(partitions, lost=False)

    def _on_lost(self, consumer: Consumer, partitions: list[TopicPartition]) -> None:
        self._released(partitions, lost=True)

    def _released(self, partitions: list[TopicPartition], lost: bool) -> None:
        for p in sorted(p.partition for p in partitions if p.partition < len(self._states)):
            with self._lock:
                event = self._states[p].released(lost)
            self._confirming[p] = None
            if isinstance(event, LeaderRevoked):
                self._hold(event)
            else:
                self._emit(event)

    def _hold(self, event: LeaderRevoked) -> None:
        """Emit a revocation, whose listener may wait for its work in flight, while the terms of
        the other partitions stay proven (:mod:`leader.hold`)."""
        c = self._config

        def owned() -> list[int]:
            with self._lock:
                return [p for p, state in enumerate(self._states) if state.owned]

        hold(
            lambda: self._emit(event),
            owned=owned,
            topic=c.topic,
            consumer_config={**common_config(c), "group.id": c.group_id, "auto.offset.reset": "latest"},
            pause=c.min_poll_interval,
            poll_batch=c.poll_batch,
            pulse=self._beat_all,
            read=self._proof,
        )

    def _beat_all(self) -> None:
        assert self._producer is not None
        for partition in range(len(self._states)):
            self._beat(partition)
        self._producer.poll(0)

    def _proof(self, message: Message) -> None:
        """A heartbeat read back outside the group (:mod:`leader.hold`): proof for a term; a
        probe's proof waits for the group's consumer, which commits."""
        sender, partition = decode_heartbeat(message.value()), message.partition()
        if sender is not None and partition is not None:
            with self._lock:
                self._states[partition].heartbeat(sender, self._clock())

    def _shutdown(self) -> None:
        assert self._consumer is not None and self._producer is not None
        for state in self._states:
            with self._lock:
                # Past its deadline the term is fenced, not handed over.
                event = state.tick(self._clock())
            self._emit(event)
            with self._lock:
                event = state.released(lost=False)
            # LeaderRevoked before leaving: the partition stays ours until the handler has wrapped up.
            self._emit(event)
        try:
            self._consumer.close()
        except KafkaException as e:
            log.warning("leader_consumer_close_failed", error=str(e.args[0]))
        # Unsent heartbeats are moot once we left; serving their purge reports lets the client end quietly.
        self._producer.purge()
        self._producer.flush(1.0)

    def _emit(self, event: LeaderEvent | None) -> None:
        if event is None:
            return
        log.info(
            "leader_event",
            kind=type(event).__name__,
            leader_id=str(event.leader_id),
            member=self._config.name,
            shard=event.shard,
        )
        try:
            self._on_event(event)
        except Exception:
            log.exception("leader_event_handler_failed", kind=type(event).__name__)

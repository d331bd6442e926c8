"""Reading the topics back and checking them against the ledger: loss, per-key order, duplicates."""

from __future__ import annotations

import time
from collections.abc import Sequence
from collections.abc import Set as AbstractSet
from dataclasses import dataclass, field

from confluent_kafka import Consumer, KafkaError, Message, TopicPartition

from harvester.client.dedup import DedupReader
from harvester.core.identity import Identity
from tests.engine.workload import check
from tests.support.kafka import consumed_headers
from tests.support.names import unique


def read_all(
    bootstrap: str, topics: Sequence[str], partitions: int, timeout: float, *, dedup: bool = False
) -> list[Message]:
    """Every message of ``topics`` from the beginning, as a ``read_committed`` consumer sees them
    (partition by partition in offset order, partitions interleaved), up to each partition's end;
    with ``dedup``, through :class:`harvester.client.dedup.DedupReader`, which drops re-deliveries."""
    consumer = Consumer(
        {
            "bootstrap.servers": bootstrap,
            "group.id": unique("chaos-check"),
            "enable.auto.commit": False,
            "enable.partition.eof": True,
            "isolation.level": "read_committed",
        }
    )
    consume = DedupReader(consumer).consume if dedup else consumer.consume
    out: list[Message] = []
    try:
        ends = {
            (t, p): consumer.get_watermark_offsets(TopicPartition(t, p), timeout=30)[1]
            for t in topics
            for p in range(partitions)
        }
        consumer.assign([TopicPartition(t, p, 0) for t, p in ends])
        pending = {tp for tp, end in ends.items() if end > 0}
        deadline = time.monotonic() + timeout
        while pending:
            if time.monotonic() > deadline:
                raise TimeoutError(f"partitions not read to their end: {sorted(pending)}")
            for m in consume(1000, 0.5):
                err = m.error()
                if err is None:
                    out.append(m)
                elif err.code() == KafkaError._PARTITION_EOF:
                    topic, partition = m.topic(), m.partition()
                    assert topic is not None and partition is not None  # an end-of-partition event names it
                    if (m.offset() or 0) >= ends[(topic, partition)]:
                        pending.discard((topic, partition))
                else:
                    raise RuntimeError(str(err))
    finally:
        consumer.close()
    return out


def first_copies(messages: Sequence[Message]) -> tuple[list[Message], int]:
    """Drop every copy of an already seen identity (producer, outbox id), with unbounded memory;
    also return how many messages carried no identity (they are kept)."""
    seen: set[tuple[str, int]] = set()
    kept: list[Message] = []
    unidentified = 0
    for m in messages:
        ident = Identity.from_headers(consumed_headers(m))
        if ident is None:
            unidentified += 1
        elif (ident.producer, ident.id) in seen:
            continue
        else:
            seen.add((ident.producer, ident.id))
        kept.append(m)
    return kept, unidentified


@dataclass
class Findings:
    """What the topics say, checked against the ledger."""

    records_read: int = 0
    lost: list[str] = field(default_factory=list)  # "<key>:<seq>" never delivered, yet purged
    out_of_order: dict[str, list[str]] = field(default_factory=dict)  # key -> its first deliveries
    unexpected: int = 0
    duplicates: int = 0  # re-deliveries a read_committed consumer sees
    unidentified: int = 0  # messages without identity headers
    # Duplicates left after dropping every repeated identity: not 0 means one record was written
    # twice under different outbox ids (a writer bug), which no reader could undo.
    left_by_identity: int = 0
    dedup_dropped: int = 0  # messages harvester.client.dedup.DedupReader dropped
    dedup_left: int = 0  # duplicates it let through
    dedup_damage: list[str] = field(default_factory=list)  # keys it lost or reordered
    dedup_missed: dict[str, list[str]] = field(default_factory=dict)  # value let through twice -> key history


def analyse(
    messages: Sequence[Message], deduped: Sequence[Message], expected: dict[str, int], undelivered: AbstractSet[str]
) -> Findings:
    """Loss, per-key order of first deliveries, and duplicates; ``deduped`` is what the
    de-duplicating reader returned for the same topics, ``undelivered`` the values still in the
    outbox (missing from the topics, but not lost)."""
    verdict = check(messages, expected)
    unique_copies, unidentified = first_copies(messages)
    reader = check(deduped, expected)
    findings = Findings(
        records_read=len(messages),
        unexpected=verdict.unexpected,
        duplicates=verdict.duplicates,
        unidentified=unidentified,
        left_by_identity=check(unique_copies, expected).duplicates,
        dedup_dropped=len(messages) - len(deduped),
        dedup_left=reader.duplicates,
        # Damage done by the reader itself: what it lost or reordered beyond the raw topics.
        dedup_damage=sorted(
            (set(reader.lost) - set(verdict.lost)) | (set(reader.out_of_order) - set(verdict.out_of_order))
        ),
    )
    missed: list[str] = []
    passed: set[str] = set()
    for m in deduped:
        value = (m.value() or b"").decode()
        if value in passed and len(missed) < 10:
            missed.append(value)
        passed.add(value)
    suspects = set(verdict.lost) | set(verdict.out_of_order) | {v.split(":")[0] for v in missed}
    deliveries: dict[str, list[Message]] = {k: [] for k in suspects}
    for m in messages:
        key = (m.key() or b"").decode()
        if key in deliveries:
            deliveries[key].append(m)
    for key in verdict.lost:
        got = {_seq(m) for m in deliveries[key]}
        findings.lost += [
            f"{key}:{s}" for s in range(expected[key]) if s not in got and f"{key}:{s}" not in undelivered
        ]
    for key in verdict.out_of_order:
        firsts: list[str] = []
        seen: set[int] = set()
        for m in deliveries[key]:
            if _seq(m) not in seen:
                seen.add(_seq(m))
                firsts.append(_describe(m))
        findings.out_of_order[key] = firsts
    for value in missed:
        history = deliveries[value.split(":")[0]]
        copies = [i for i, m in enumerate(history) if (m.value() or b"").decode() == value]
        window = history[max(0, copies[0] - 3) : copies[-1] + 2]  # from before the first copy to after the last
        findings.dedup_missed[value] = [_describe(m) for m in window]
    return findings


def broken_guarantees(f: Findings, delivery: str) -> list[str]:
    """What the topics show broken: a loss, a key out of order, an unexpected message, (exactly-once)
    a duplicate read ``read_committed``, or a duplicate the de-duplicating reader cannot undo."""
    out = []
    if f.lost:
        out.append(f"{len(f.lost)} records lost")
    if f.out_of_order:
        out.append(f"{len(f.out_of_order)} keys with first deliveries out of order")
    if f.unexpected:
        out.append(f"{f.unexpected} unexpected messages (key/value not in the ledger)")
    if delivery == "exactly_once" and f.duplicates:
        out.append(f"{f.duplicates} duplicates seen by a read_committed consumer in exactly-once mode")
    if f.left_by_identity:
        out.append(f"{f.left_by_identity} duplicates under different identities (written twice?)")
    if f.dedup_left:
        out.append(f"{f.dedup_left} duplicates left after harvester.client.dedup.DedupReader")
    if f.dedup_damage:
        out.append(f"harvester.client.dedup.DedupReader lost or reordered records of keys {f.dedup_damage[:10]}")
    if f.unidentified:
        out.append(f"{f.unidentified} messages without identity headers")
    return out


def _describe(m: Message) -> str:
    """``seq#outbox-id@p<partition>/o<offset>/e<epoch>`` of a delivery."""
    ident = Identity.from_headers(consumed_headers(m))
    where = f"@p{m.partition()}/o{m.offset()}"
    return f"{_seq(m)}{where}/e?" if ident is None else f"{_seq(m)}#{ident.id}{where}/e{ident.epoch}"


def _seq(m: Message) -> int:
    return int((m.value() or b"").decode().split(":")[1])

"""CPU per record of the log source's hot functions, driven in loops without PostgreSQL or Kafka, to
compare builds of the same modules (pure Python or compiled) on a shared machine.

    python bench/hot_paths.py [--records 50000] [--repeat 5] [--keys 1000] [--json]

Each component runs ``--repeat`` times over ``--records`` records and prints the median, minimum and
maximum of ``time.thread_time`` per record (this thread's CPU, robust to other processes' load):

- ``stream``: ``LogicalStream.read`` of the same rows as one transaction the walsender streams in
  progress (Stream Start, the Relation, 1,000 inserts with their xid, Stream Stop, ..., Stream
  Commit), as copy data a stand-in for psycopg's connection hands out as psycopg does (a
  ``memoryview`` each), with the log store's stream decoder: until the Stream Commit gives them
- ``receive``: ``Transactions.receive`` of pgoutput messages as the walsender sends a burst (Begin,
  the outbox's Relation, 1,000 inserts of the usual layout, Commit), binary values, 100-byte value
- ``decode``: ``TableInserts.records`` of the buffered inserts (``outbox_record``, the usual layout)
- ``hand_out``: ``Transactions.take``, ``handed_out`` and the stamp, as ``LogStore._fresh`` does,
  then ``completed`` of all of them in acknowledgement batches of 1,000 (the purge thread's part)
- ``gate``: ``KeyGate`` under the log source's policy: ``hold_back`` and ``sent`` per record, then
  ``answered`` and ``done`` per batch of 1,000 reports (the dispatcher's and completion's share)
- ``publish``: ``ProcessPublisher.publish`` of each batch of 1,000 and ``frames.send`` of its frame
  (columns) to /dev/null (the harvester-produce thread's pickling)
- ``child_produce``: in the producer process, ``frames.receive`` of those frames and the Python
  loop's ``produce`` of each into a real confluent-kafka producer whose broker never answers
  (librdkafka queues it: ``produce``'s own C work is in the figure; ``bench/pipe.py`` measures the
  native loop)
- ``child_report``: the delivery callback that ``produce`` made, called as the poll thread would,
  and the frame of the acknowledged numbers the loop's ``take`` gives
- ``reports``: the harvester's ``ProcessPublisher._receive`` of those frames, each report put on a
  queue as the dispatcher's callback does

The garbage collector is tuned as the reaper's (``harvester.runtime``). Which build runs is whatever
``harvester`` imports: to compare two builds (pure Python and compiled, as in docs/benchmarks.md's
"2026-11-28: the hot modules compiled with mypyc", or two checkouts), run it with the other one first on
``PYTHONPATH``, alternating; ``--json`` prints the figures for a script."""

from __future__ import annotations

import argparse
import io
import json
import os
import queue
import statistics
import struct
import threading
import time
from collections.abc import Callable
from typing import Any
from uuid import uuid4

import harvester.core.gate as gate_module
from harvester.core.gate import KeyGate, release_at_ack
from harvester.core.identity import IdentityHeaders, Stamp
from harvester.core.records import MarkedRecord
from harvester.kafka import frames, process_publisher, producer_process
from harvester.kafka.numbered import columns
from harvester.postgres.log.decoding import TableInserts
from harvester.postgres.log.records import PUBLISHED
from harvester.postgres.log.replication import LogicalStream
from harvester.postgres.log.streamed import StreamedTransactions
from harvester.postgres.log.transactions import Taken, Transactions
from harvester.runtime import tune_garbage_collector

OID = 16_500
VALUE = b"x" * 100  # bench/workload.py's VALUE
BATCH = 1000
_TYPES = {"id": 20, "create_time": 1184, "kafka_topic": 25, "kafka_key": 25, "kafka_value": 25}


def relation() -> bytes:
    columns = b"".join(
        b"\x00" + name.encode() + b"\0" + struct.pack("!Ii", _TYPES.get(name, 1009), -1) for name in PUBLISHED
    )
    return b"R" + struct.pack("!I", OID) + b"public\0outbox\0d" + struct.pack("!H", len(PUBLISHED)) + columns


def insert(rid: int, micros: int, topic: bytes, key: bytes) -> bytes:
    empty = struct.pack("!iii", 0, 0, 25)
    values = [struct.pack("!q", rid), struct.pack("!q", micros), topic, key, VALUE, empty, empty]
    body = b"".join(b"b" + struct.pack("!i", len(v)) + v for v in values)
    return b"I" + struct.pack("!I", OID) + b"N" + struct.pack("!H", len(values)) + body


def burst(records: int, keys: int) -> list[bytes]:
    """The walsender's messages of a COPY of ``records`` rows in transactions of 1,000."""
    out: list[bytes] = []
    micros = 848_000_000_000_000
    lsn = 1 << 32
    for start in range(0, records, BATCH):
        out.append(b"B" + struct.pack("!QqI", lsn + 10_000, micros, 700 + start))
        out.append(relation())
        out += [insert(1 + i, micros, b"bench-topic", f"key{i % keys}".encode()) for i in range(start, start + BATCH)]
        out.append(b"C\0" + struct.pack("!QQq", lsn + 10_000, lsn + 10_100, micros))
        lsn += 20_000
    return out


def streamed_copy_data(messages: list[bytes], xid: int = 700) -> list[bytes]:
    """``messages`` (Begin, Relation, inserts, Commit, ...) as the copy data of one transaction the
    walsender streams in progress: each change with the xid after its kind, a block per 1,000."""
    head = b"w" + bytes(24)  # XLogData: 'w', two LSNs and a time, which the reader skips
    changes = [m[:1] + struct.pack("!I", xid) + m[1:] for m in messages if m[:1] in (b"R", b"I")]
    out: list[bytes] = []
    for start in range(0, len(changes), BATCH):
        out.append(head + b"S" + struct.pack("!IB", xid, 1 if start == 0 else 0))
        out += [head + c for c in changes[start : start + BATCH]]
        out.append(head + b"E")
    out.append(head + b"c" + struct.pack("!IbQQq", xid, 0, 1 << 33, (1 << 33) + 100, 848_000_000_000_000))
    return out


class _CopyData:
    """psycopg's libpq connection as the stream reads it, over copy data already received."""

    def __init__(self, items: list[bytes]) -> None:
        self._items, self._next = items, 0

    def get_copy_data(self, _async: int) -> tuple[int, memoryview | bytes]:
        if self._next == len(self._items):
            return 0, b""
        item = self._items[self._next]
        self._next += 1
        return len(item), memoryview(item)

    def consume_input(self) -> None:
        pass


def read_stream(items: list[bytes], records: int) -> None:
    """What ``LogicalStream.read`` gives of ``items``: a stream made without a server (its state as
    its constructor leaves it, but the connection), read until it gave the transaction."""
    stream = LogicalStream.__new__(LogicalStream)
    stream.server_end, stream._flushed, stream.drained, stream._reported = 0, 0, True, time.monotonic()
    stream.streamed = StreamedTransactions(lambda: TableInserts().stream_decoder(OID))
    stream._raw, stream._at = [], 0
    stream._conn = _CopyData(items)  # type: ignore[assignment]
    given = 0
    while given < records:
        got = stream.read(5000)
        if not got and stream.drained:
            raise AssertionError(f"the stream gave {given} of {records} records")
        given += sum(not isinstance(m, bytes) for m in got)


def _cpu(run: Callable[[], None]) -> float:
    start = time.thread_time()
    run()
    return time.thread_time() - start


def measure(records: int, keys: int) -> dict[str, float]:
    """One repetition: CPU seconds of each component over ``records`` records."""
    out: dict[str, float] = {}
    messages = burst(records, keys)
    copy_data = streamed_copy_data(messages)
    out["stream"] = _cpu(lambda: read_stream(copy_data, records))
    txns = Transactions(b"I", OID.to_bytes(4, "big"), 1, OID)
    out["receive"] = _cpu(lambda: txns.receive(messages))
    leader = uuid4()
    txns.start_pass(leader)
    taken: Taken = txns.take(leader, records)
    decoding = TableInserts()
    decoded: list[MarkedRecord] = []
    out["decode"] = _cpu(lambda: decoded.extend(decoding.records(taken)))
    stamp = Stamp.of(IdentityHeaders(), 3, b"bench-producer")

    def hand_out() -> None:
        again = uuid4()
        txns.start_pass(again)  # a pass again: take() hands the same inserts out
        for start in range(0, records, BATCH):
            part, batch = txns.take(again, BATCH), decoded[start : start + BATCH]
            skipped = txns.handed_out(part, [record.id for record in batch])
            for record in [r for r in batch if r.id not in skipped] if skipped else batch:
                record.stamp = stamp
        for start in range(0, records, BATCH):
            txns.completed([r.id for r in decoded[start : start + BATCH]], 0)

    out["hand_out"] = _cpu(hand_out)
    out["gate"] = _cpu(lambda: drive_gate(decoded))
    sent: list[bytes] = []
    out["publish"] = _cpu(lambda: publish(decoded, sent))
    report_frames: list[bytes] = []
    out["child_produce"], out["child_report"] = child(sent, report_frames)
    out["reports"] = _cpu(lambda: reports(decoded, report_frames))
    return out


def drive_gate(records: list[MarkedRecord]) -> None:
    gate = KeyGate(release_at_ack(True))
    now = time.monotonic()
    waiting: list[MarkedRecord] = []
    for start in range(0, len(records), BATCH):
        part = records[start : start + BATCH]
        for record in part:
            if not gate.hold_back(record, now):
                gate.sent(record)
            else:
                waiting.append(record)
        items = [(r, None) for r in part if r not in waiting]
        gate.answered(items)
        gate.done([r for r, _ in items], [r.id for r, _ in items], [])
        waiting.clear()
        gate.discard_waiting()


def idle_publisher(on_delivery: Callable[[Any], None]) -> process_publisher.ProcessPublisher:
    """A publisher whose child was started and closed: what it publishes stays in its outgoing list.
    (A compiled class's ``__new__`` runs ``__init__``, so it is built whole.)"""
    pub = process_publisher.ProcessPublisher({"bootstrap.servers": "127.0.0.1:9", "log_level": 0}, on_delivery)
    pub.close(5.0)
    pub._outgoing, pub._numbered.pending, pub._wake = [], {}, threading.Event()
    return pub


def publish(records: list[MarkedRecord], sent: list[bytes]) -> None:
    pub = idle_publisher(lambda _: None)
    with open(os.devnull, "wb") as sink:
        for start in range(0, len(records), BATCH):
            pub.publish(records[start : start + BATCH])
            batch, pub._outgoing = pub._outgoing, []
            frame = columns(pub._numbered.next - len(batch), batch, placing=False)
            frames.send(sink, frame)
            sent.append(frames_bytes(frame))


def frames_bytes(frame: object) -> bytes:
    buffer = io.BytesIO()
    frames.send(buffer, frame)
    return buffer.getvalue()


class _Capture:
    """A producer that keeps the delivery callbacks (the poll thread's calls, made below)."""

    def __init__(self) -> None:
        self.callbacks: list[Any] = []

    def produce(self, topic: str, **kwargs: Any) -> None:
        self.callbacks.append(kwargs["on_delivery"])


def child(sent: list[bytes], report_frames: list[bytes]) -> tuple[float, float]:
    """CPU of the producer process's main thread for the frames ``sent`` (a real producer that
    queues them), and of the poll thread's share: the delivery callbacks and their report."""
    settings = {
        "bootstrap.servers": "127.0.0.1:9",  # nothing answers: librdkafka queues what it is given
        "enable.idempotence": True,
        "compression.type": "lz4",
        "linger.ms": 5,
        "queue.buffering.max.messages": 2_000_000,
        "queue.buffering.max.kbytes": 2_000_000,
        "log_level": 0,
    }
    sink = io.BytesIO()
    loop = producer_process._PythonLoop(dict(settings), False, False)
    stream = io.BytesIO(b"".join(sent))

    def produce() -> None:
        while (frame := frames.receive(stream)) is not None:
            loop.produce(*frame)

    produced = _cpu(produce)
    loop.purge()
    loop.poll(0)  # the purged records' reports (failed): not measured
    capture = producer_process._PythonLoop(dict(settings), False, False)
    capture._producer = _Capture()  # type: ignore[assignment]
    stream.seek(0)
    while (frame := frames.receive(stream)) is not None:
        capture.produce(*frame)
    callbacks = capture._producer.callbacks  # type: ignore[attr-defined]

    def acknowledge() -> None:
        for start in range(0, len(callbacks), BATCH):
            for callback in callbacks[start : start + BATCH]:
                callback(None, None)
            frames.send(sink, capture.take())

    sink.seek(0)
    sink.truncate()
    reported = _cpu(acknowledge)
    report_frames.append(sink.getvalue())
    return produced, reported


def reports(records: list[MarkedRecord], report_frames: list[bytes]) -> None:
    acks: queue.SimpleQueue[Any] = queue.SimpleQueue()
    pub = idle_publisher(acks.put_nowait)
    pub._numbered.pending = dict(enumerate(records))
    reader = io.BytesIO(b"".join(report_frames))
    pub._receive(process_publisher._Child(None, io.BytesIO(), reader, 0))  # type: ignore[arg-type]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--records", type=int, default=50_000)
    p.add_argument("--repeat", type=int, default=5)
    p.add_argument("--keys", type=int, default=1000)
    p.add_argument("--json", action="store_true")
    args = p.parse_args()
    tune_garbage_collector()  # as the reaper and its producer process do
    runs = [measure(args.records, args.keys) for _ in range(args.repeat)]
    compiled = gate_module.__file__ is not None and not gate_module.__file__.endswith(".py")
    result = {name: [1e6 * run[name] / args.records for run in runs] for name in runs[0]}
    if args.json:
        print(json.dumps({"compiled": compiled, "us_per_record": result}))
        return
    build = "compiled" if compiled else "pure Python"
    print(f"{build} ({gate_module.__file__}), {args.records} records x {args.repeat}, µs per record (median, min-max):")
    for name, values in result.items():
        print(f"  {name:14} {statistics.median(values):6.2f}  ({min(values):.2f}-{max(values):.2f})")
    total = sum(statistics.median(v) for v in result.values())
    print(f"  {'total':14} {total:6.2f}")


if __name__ == "__main__":
    main()

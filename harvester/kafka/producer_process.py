"""The producer process that :class:`harvester.kafka.process_publisher.ProcessPublisher` starts: one
librdkafka producer fed by frames from the harvester, its delivery reports sent back in frames.

``python -m harvester.kafka.producer_process IN OUT``: reads frames from file descriptor ``IN`` and
writes them to ``OUT`` (:mod:`harvester.kafka.frames`). In: first ``(settings, forward_logs,
forward_errors)``, then batches ``(first seq, topics, keys, values, headers, ids, stamps,
placements)``, a list per field with an item per record, the records numbered from ``first seq`` on
(the child appends the identity headers of each ``stamp``, a :class:`harvester.core.identity.Stamp`
or None; ``placements`` is None, or each record's ``(timestamp, partition)``: milliseconds since the
epoch, 0 for now, and -1 for the partitioner's), then ``("close", timeout)``. Out: first ``("ready",
loop)`` once the producer exists or ``(code, reason)`` when it could not be made, then reports ``(acked
seqs, [(seq, code, reason)], [(level, text)], [(code, reason, fatal)], [(code, reason)])``, the last
the producer's fatal error once it has one (Kafka refused it a producer id, say): it publishes
nothing more, and the harvester stops leading with that refusal.

The loop over the producer is native (:mod:`harvester.kafka._rdkafka_loop`, C over the librdkafka
of confluent-kafka's wheel: no Python object per record but the number acknowledged) where
``./dev.sh`` or the image built it, and in Python over confluent-kafka's producer otherwise, or when
``HARVESTER_PRODUCER_LOOP=python``; both read the same frames and send the same reports.

It imports nothing but confluent-kafka, its native loop, :mod:`harvester.kafka.frames`,
:mod:`harvester.kafka.loop`, :mod:`harvester.kafka.enqueue` and :mod:`harvester.core.identity` (and
:mod:`harvester.runtime`'s collector settings), so it starts in a tenth of a second. It ignores
SIGINT and SIGTERM, which a terminal or a service manager sends the whole group: the harvester
decides when it stops, flushing first. It exits at once when the harvester's end of the pipe closes
without a "close", or it finds its parent gone (the harvester died): what it had not delivered stays
in the outbox for the next leader.
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
import traceback
from itertools import count, repeat
from typing import Any

from confluent_kafka import KafkaError, KafkaException, Message, Producer

from harvester.core.identity import Stamp
from harvester.kafka.enqueue import Placing, enqueue
from harvester.kafka.frames import receive, send
from harvester.kafka.loop import Loop, Relay, Report, SettingsError, native_loop
from harvester.runtime import tune_garbage_collector


class _PythonLoop:
    """The loop in Python over confluent-kafka's producer, a delivery callback per record: where the
    native loop was not built, or ``HARVESTER_PRODUCER_LOOP=python`` asks for it. Delivery reports,
    librdkafka's logs and errors run on whichever thread polls: the poll thread, or the main
    thread's final flush."""

    def __init__(self, settings: dict[str, Any], forward_logs: bool, forward_errors: bool) -> None:
        self._lock = threading.Lock()  # guards the lists below: produce failures come from the main thread
        self._acked: list[int] = []
        self._failed: list[tuple[int, int, str]] = []
        self._logs: list[tuple[int, str]] = []
        self._errors: list[tuple[int, str, bool]] = []
        self._fatal: list[tuple[int, str]] = []
        if forward_logs:
            settings["logger"] = self._logger()
        if forward_errors:
            settings["error_cb"] = self._on_error
        self._producer = Producer(settings)
        self._parent = os.getppid()

    def _logger(self) -> logging.Logger:
        loop = self

        class Forward(logging.Handler):
            def emit(self, record: logging.LogRecord) -> None:
                with loop._lock:
                    loop._logs.append((record.levelno, record.getMessage()))

        logger = logging.getLogger("rdkafka")
        logger.setLevel(logging.DEBUG)  # the harvester's logger decides what it shows
        logger.propagate = False
        logger.addHandler(Forward())
        return logger

    def _on_error(self, error: KafkaError) -> None:
        with self._lock:
            self._errors.append((error.code(), error.str(), error.fatal()))

    def poll(self, timeout: float) -> None:
        try:
            self._producer.poll(timeout)
        except KafkaException as exc:
            # A fatal error (raised once, by poll): polling goes on, so the records the producer
            # holds come back failed after it.
            self._failed_for_good(exc.args[0])

    def take(self) -> Report | None:
        with self._lock:
            frame = (self._acked, self._failed, self._logs, self._errors, self._fatal)
            if not any(frame):
                return None
            self._acked, self._failed, self._logs, self._errors, self._fatal = [], [], [], [], []
        return frame

    def produce(
        self,
        first: int,
        topics: list[str],
        keys: list[str],
        values: list[bytes | None],
        headers: list[Any],
        ids: list[int],
        stamps: list[Stamp | None],
        placements: list[tuple[int, int]] | None,
    ) -> None:
        producer, exit_if_orphaned, fail = self._producer, self._exit_if_orphaned, self._fail
        places = repeat(None) if placements is None else placements
        for seq, topic, key, value, own, rid, stamp, place in zip(
            count(first), topics, keys, values, headers, ids, stamps, places
        ):
            sent = own if stamp is None else [*own, *stamp.headers(rid)] if own else stamp.headers(rid)

            def delivered(err: KafkaError | None, _msg: Message, seq: int = seq) -> None:
                if err is None:
                    self._acked.append(seq)  # only the polling thread appends here, and swaps the list
                else:
                    fail(seq, err)

            to = producer if place is None else Placing(producer, *place)
            error = enqueue(to, topic, key, value, sent, delivered, exit_if_orphaned)
            if error is not None:
                fail(seq, error)

    def _exit_if_orphaned(self) -> None:
        """While the queue is full: a harvester that died is not waited for (its pipe's end is not
        read now)."""
        if os.getppid() != self._parent:
            os._exit(0)

    def _fail(self, seq: int, error: KafkaError) -> None:
        with self._lock:
            self._failed.append((seq, error.code(), error.str()))

    def _failed_for_good(self, error: KafkaError) -> None:
        with self._lock:
            self._fatal.append((error.code(), error.str()))

    def flush(self, timeout: float) -> int:
        try:
            return self._producer.flush(timeout)
        except KafkaException as exc:  # the fatal error, raised here rather than in the poll thread
            self._failed_for_good(exc.args[0])
            return len(self._producer)

    def purge(self) -> None:
        self._producer.purge()


def _make_loop(settings: dict[str, Any], forward_logs: bool, forward_errors: bool) -> tuple[Loop, str]:
    """The loop ``HARVESTER_PRODUCER_LOOP`` names (``native``, the default, when it was built), and
    its name; raises :class:`SettingsError` when librdkafka refuses the settings."""
    if os.environ.get("HARVESTER_PRODUCER_LOOP", "native") == "native":
        loop = native_loop(settings, forward_logs, forward_errors)
        if loop is not None:
            return loop, "native"
    try:
        return _PythonLoop(settings, forward_logs, forward_errors), "python"
    except KafkaException as exc:
        raise SettingsError(exc.args[0].code(), exc.args[0].str()) from None


def _exit_at(error: BaseException) -> None:
    """The poll thread failed: nothing would report any more, so the child ends; the harvester sees
    the pipe close and fails the rest."""
    traceback.print_exception(error)
    os._exit(1)


def main(argv: list[str]) -> None:
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    signal.signal(signal.SIGTERM, signal.SIG_IGN)
    inbound = os.fdopen(int(argv[1]), "rb")
    out = os.fdopen(int(argv[2]), "wb")
    settings, forward_logs, forward_errors = receive(inbound)
    try:
        loop, name = _make_loop(settings, forward_logs, forward_errors)
    except SettingsError as exc:
        send(out, exc.args)
        return
    relay = Relay(loop, lambda frame: send(out, frame), _exit_at)
    # The Python loop's delivery callback per record in flight, tens of thousands of them: the default
    # collector thresholds cost a fifth of its time collecting them, reference counting frees them.
    tune_garbage_collector()
    send(out, ("ready", name))
    relay.start()
    while (frame := receive(inbound)) is not None:
        if frame[0] == "close":
            relay.close(frame[1])
            return
        loop.produce(*frame)
    os._exit(0)  # the harvester is gone: drop the producer's queue without waiting for it


if __name__ == "__main__":
    main(sys.argv)

"""Publishing through a producer in a child process, so that the harvester's interpreter spends no
time in ``produce`` or in delivery callbacks: about a third of the log source's work per record,
which a second core then does (docs/log-source.md, "The producer process").

Records cross a pipe in batches of columns (one list of topics, one of keys, ...), numbered in
publish order: a tuple per record cost more to pickle here and to unpickle in the child
(docs/benchmarks.md, "the producer process's batches as columns"). The child
(:mod:`harvester.kafka.producer_process`) produces them in that order with the same settings as
:class:`~harvester.kafka.publisher.KafkaPublisher`, so order is kept exactly as there. Reports come
back as the numbers acknowledged and the errors of the rest. librdkafka's logs and errors come back
too, to the logger and error callback the configuration names.

A child that exits unasked (or cannot be started) fails every record not yet reported, with a
retriable error, and the next batch starts another child. Batches are numbered by the child they are
for: one taken before the failure is dropped, never sent to the next child, because its records were
just reported failed and their retries must not follow copies of them. Order needs one more rule: an
order-keeping producer fails a key's records after a failed one too, so until the dispatcher has
closed the key (it learns of the failures only as it reads their reports), a record of a key with a
record failed so fails at once; the key is open again at the retry of its first failed record (the
remark sends it first), or at a new term (:meth:`ProcessPublisher.begin_term`).

A producer that failed for good (Kafka refused it a producer id) is reported by its child, which
goes on: as in-process, its records come back failed with that refusal and the next publish raises it.
"""

from __future__ import annotations

import contextlib
import logging
import os
import subprocess
import sys
import threading
import time
from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, BinaryIO

import structlog
from confluent_kafka import KafkaError, KafkaException

from harvester.core.protocols import DeliveryCallback
from harvester.core.records import MarkedRecord
from harvester.kafka.frames import receive, send
from harvester.kafka.numbered import Numbered, columns
from harvester.kafka.publisher import DeliveryError, delivery_settings

log = structlog.get_logger("harvester.kafka")

# The settings that are Python callables the child cannot be given: it forwards what they receive.
_FORWARDED = ("logger", "error_cb")
_START_TIMEOUT = 30.0  # seconds for a child to import confluent-kafka and make its producer
_EXITED = "the producer process exited"
_BLOCKED = "an earlier record of its key failed with a producer process that exited"
# Beyond the flush's timeout, how long a close waits for the child to report and exit.
_CLOSE_MARGIN = 10.0


def runs_in_child(config: Mapping[str, Any]) -> bool:
    """Whether a producer with ``config`` can run in a child: no Python callable in it but those
    whose calls are forwarded back."""
    return not any(callable(v) for k, v in config.items() if k not in _FORWARDED)


@dataclass(slots=True)
class _Child:
    process: subprocess.Popen[bytes]
    writer: BinaryIO
    reader: BinaryIO
    generation: int
    loop: str = ""  # the child's loop over its producer: "native" or "python"
    receiver: threading.Thread = field(init=False)


class ProcessPublisher:
    """:class:`harvester.core.protocols.Publisher` whose producer runs in a child process."""

    # Whether records may be placed (timestamps, partitions of their own): the frames then carry them.
    _placing = False

    def __init__(self, config: Mapping[str, Any], on_delivery: DeliveryCallback, *, in_order: bool = False) -> None:
        """Start the child and its producer; raises ``KafkaException`` when the producer's settings
        are refused, as :class:`~harvester.kafka.publisher.KafkaPublisher` does."""
        settings = dict(config)
        self._logger: logging.Logger | None = settings.pop("logger", None)
        self._error_cb: Callable[[KafkaError], None] | None = settings.pop("error_cb", None)
        self._settings, self.keeps_order = delivery_settings(settings, in_order)
        self._on_delivery = on_delivery
        self._numbered = Numbered(on_delivery, self._logger, self._error_cb)
        self._lock = threading.Lock()  # guards the fields below
        self._outgoing: list[MarkedRecord] = []  # numbered from next - len(_outgoing) on
        self._generation = 0  # the current child's; bumped when a child exits unasked
        # Per key with records failed by a lost child, the first of their ids (see the module's doc).
        self._blocked: dict[str, int] = {}
        self._closing: float | None = None  # the close's timeout, once closing
        self._wake = threading.Event()
        self._child = self._spawn(0)
        self._sender = threading.Thread(target=self._send_loop, name="harvester-produce", daemon=True)
        self._sender.start()

    @property
    def loop(self) -> str:
        """The producer process's loop: "native" (C over librdkafka) or "python"."""
        return self._child.loop

    @property
    def child_pid(self) -> int:
        """The producer process's id (a new one after a child exited unasked)."""
        return self._child.process.pid

    def publish(self, records: Sequence[MarkedRecord]) -> None:
        """Queue ``records`` for the child; their reports reach the callback from the receiving
        thread. Raises :class:`RefusedError` once the child's producer failed for good."""
        if self._numbered.refused is not None:
            raise self._numbered.refused
        with self._lock:
            if self._blocked:
                records = [record for record in records if not self._blocks(record)]
            self._numbered.number(records)
            if not self._outgoing:
                self._wake.set()
            self._outgoing.extend(records)

    def _blocks(self, record: MarkedRecord) -> bool:
        """Whether ``record`` fails at once, a record of its key having failed before it with a child
        that exited (caller holds the lock); its key opens at the first of those."""
        first = self._blocked.get(record.key)
        if first is None:
            return False
        if record.id > first:
            self._on_delivery((record, DeliveryError(KafkaError(KafkaError._FAIL, _BLOCKED))))
            return True
        del self._blocked[record.key]
        return False

    def begin_term(self) -> None:
        """A new term re-reads everything not done in order: no key waits for a retry any more."""
        with self._lock:
            self._blocked.clear()

    def close(self, timeout: float) -> None:
        """Send what is queued, have the child flush (bounded by ``timeout``) and fail what it could
        not deliver, then wait for it to exit; a child still there after ``timeout`` and a margin
        (a child that does not read, say) is killed."""
        deadline = time.monotonic() + timeout + _CLOSE_MARGIN
        with self._lock:
            self._closing = timeout
            self._wake.set()
        self._sender.join(max(0.0, deadline - time.monotonic()))
        if self._sender.is_alive():  # blocked writing to the child (or starting one): unblocked so
            self._child.process.kill()
            self._sender.join()
        child = self._child
        child.receiver.join(max(0.0, deadline - time.monotonic()))
        if child.receiver.is_alive():
            child.process.kill()
            child.receiver.join()

    # ------------------------------------------------------------------ the child

    def _spawn(self, generation: int) -> _Child:
        """Start a child for ``generation`` and wait until its producer exists."""
        down_read, down_write = os.pipe()
        up_read, up_write = os.pipe()
        package_root = str(Path(__file__).resolve().parents[2])
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(filter(None, [package_root, os.environ.get("PYTHONPATH")]))}
        # -P: the child imports this process's package, not one in the working directory (``-m``
        # would put it first), whose frames could differ.
        command = [sys.executable, "-P", "-m", "harvester.kafka.producer_process", str(down_read), str(up_write)]
        try:
            process = subprocess.Popen(command, pass_fds=(down_read, up_write), env=env)
        except BaseException:
            for fd in (down_read, down_write, up_read, up_write):
                os.close(fd)
            raise
        finally:
            with contextlib.suppress(OSError):  # the child's ends: closed here once it has them
                os.close(down_read)
                os.close(up_write)
        child = _Child(process, os.fdopen(down_write, "wb"), os.fdopen(up_read, "rb"), generation)
        try:
            send(child.writer, (self._settings, self._logger is not None, self._error_cb is not None))
            started = _answer(child)
        except OSError as exc:
            started = (KafkaError._FAIL, f"the producer process exited at start: {exc}")
        if not isinstance(started, str):
            process.kill()
            process.wait()
            _close(child)
            raise KafkaException(KafkaError(*started))
        child.loop = started
        child.receiver = threading.Thread(
            target=self._receive_loop, args=(child,), name="harvester-delivery", daemon=True
        )
        child.receiver.start()
        return child

    def _send_loop(self) -> None:
        while True:
            self._wake.wait()
            with self._lock:
                batch, self._outgoing = self._outgoing, []
                first = self._numbered.next - len(batch)
                generation, closing = self._generation, self._closing
                self._wake.clear()
            try:
                if batch:
                    self._send(first, batch, generation)
            except Exception:
                # Never leave records unreported: the child goes, and its receiver fails them.
                log.exception("producer_process_send_failed", records=len(batch))
                self._child.process.kill()
            if closing is not None:
                self._stop_child(closing)
                return

    def _send(self, first: int, batch: list[MarkedRecord], generation: int) -> None:
        if generation != self._child.generation:
            if generation != self._generation:
                return  # for a child that exited: these records were reported failed with it
            try:
                self._child = self._spawn(generation)
            except Exception as exc:
                log.error("producer_process_start_failed", error=str(exc))
                self._lose(generation, str(exc))  # the batch's records, and all published since
                return
        frame = columns(first, batch, self._placing)
        # A child that exited fails the batch with everything else pending (its receiver does, and
        # closes the pipe: ValueError then).
        with contextlib.suppress(OSError, ValueError):
            send(self._child.writer, frame)

    def _stop_child(self, timeout: float) -> None:
        with contextlib.suppress(OSError, ValueError):  # exited already: its receiver reports what it left
            send(self._child.writer, ("close", timeout))
            self._child.writer.close()

    def _receive_loop(self, child: _Child) -> None:
        try:
            self._receive(child)
        except Exception:
            log.exception("producer_process_reports_failed")
            child.process.kill()
        finally:
            code = child.process.wait()
            _close(child)
            if self._closing is None:
                log.error("producer_process_exited", exit_code=code, records=len(self._numbered.pending))
            self._lose(child.generation, _EXITED)

    def _receive(self, child: _Child) -> None:
        apply = self._numbered.apply
        while (frame := receive(child.reader)) is not None:
            apply(frame)

    def _lose(self, generation: int, reason: str) -> None:
        """The child of ``generation`` is gone (or never came): every record not reported fails, its
        key failing at once until it is retried, and the next batch starts another child."""
        with self._lock:
            pending = self._numbered.pending
            left = [pending.pop(seq) for seq in list(pending)]
            self._outgoing.clear()
            self._generation = max(self._generation, generation + 1)
            for record in left:
                first = self._blocked.get(record.key)
                if first is None or record.id < first:
                    self._blocked[record.key] = record.id
            # Reported under the lock: a record of their keys published meanwhile fails after them.
            for record in left:
                self._on_delivery((record, DeliveryError(KafkaError(KafkaError._FAIL, reason))))


class PlacingProcessPublisher(ProcessPublisher):
    """A :class:`ProcessPublisher` of records that may have a timestamp or partition of their own
    (:class:`~harvester.core.records.PlacedRecord`): its frames carry them, which the others' need not."""

    _placing = True


def _close(child: _Child) -> None:
    for stream in (child.writer, child.reader):
        with contextlib.suppress(OSError):
            stream.close()


def _answer(child: _Child) -> str | tuple[int, str]:
    """The child's loop once its producer exists, else the error that refused it (or stopped the child)."""
    answer: list[Any] = []
    reader = threading.Thread(target=lambda: answer.append(receive(child.reader)), daemon=True)
    reader.start()
    reader.join(_START_TIMEOUT)
    if not answer:
        child.process.kill()
        return (KafkaError._FAIL, f"the producer process did not start within {_START_TIMEOUT:.0f} s")
    if isinstance(answer[0], tuple) and answer[0][0] == "ready":
        loop: str = answer[0][1]
        return loop
    if answer[0] is None:
        return (KafkaError._FAIL, f"the producer process exited at start (code {child.process.wait()})")
    refused: tuple[int, str] = answer[0]
    return refused

"""Publishing through the native loop (:mod:`harvester.kafka.loop`) in the harvester's own process:
a sender thread hands each batch's columns to librdkafka, which produces them without the GIL, and a
poll thread reports on them. The producer process (:mod:`harvester.kafka.process_publisher`) runs
the same loop in a child, which costs a pickled frame across a pipe per batch and per report: in
1,000,000-record drains this publisher took the relay's CPU per record down by about a tenth
(docs/benchmarks.md, "the native loop in the harvester's process"). It needs the native
loop built (``./dev.sh`` and the image build it); where it was not, the producer process runs the
loop in Python. Order, numbering and reports are the producer process's: the same settings, one
report per record.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Callable, Mapping, Sequence
from typing import Any

import structlog
from confluent_kafka import KafkaError, KafkaException

from harvester.core.protocols import DeliveryCallback, RefusedError
from harvester.core.records import MarkedRecord
from harvester.kafka.loop import Relay, SettingsError, native_loop
from harvester.kafka.numbered import Numbered, columns
from harvester.kafka.publisher import DeliveryError, delivery_settings

log = structlog.get_logger("harvester.kafka")


def native_built() -> bool:
    """Whether the native loop was built for this Python."""
    try:
        from harvester.kafka import _rdkafka_loop  # noqa: F401
    except ImportError:
        return False
    return True


class NativePublisher:
    """:class:`harvester.core.protocols.Publisher` over the native loop in this process."""

    # Whether records may be placed (timestamps, partitions of their own): the columns then carry them.
    _placing = False

    def __init__(self, config: Mapping[str, Any], on_delivery: DeliveryCallback, *, in_order: bool = False) -> None:
        """Start the producer; raises ``KafkaException`` when its settings are refused, as
        :class:`~harvester.kafka.publisher.KafkaPublisher` does."""
        settings = dict(config)
        logger: logging.Logger | None = settings.pop("logger", None)
        error_cb: Callable[[KafkaError], None] | None = settings.pop("error_cb", None)
        settings, self.keeps_order = delivery_settings(settings, in_order)
        try:
            loop = native_loop(settings, logger is not None, error_cb is not None, exit_when_orphaned=False)
        except SettingsError as exc:
            raise KafkaException(KafkaError(*exc.args)) from None
        if loop is None:
            raise RuntimeError("the native producer loop was not built (./dev.sh builds it)")
        self._numbered = Numbered(on_delivery, logger, error_cb)
        self._relay = Relay(loop, self._numbered.apply, self._poll_failed)
        self._lock = threading.Lock()  # guards the fields below and the numbering
        self._outgoing: list[MarkedRecord] = []  # numbered from next - len(_outgoing) on
        self._closing: float | None = None  # the close's timeout, once closing
        self._wake = threading.Event()
        self._relay.start()
        self._sender = threading.Thread(target=self._send_loop, name="harvester-produce", daemon=True)
        self._sender.start()

    def publish(self, records: Sequence[MarkedRecord]) -> None:
        """Queue ``records`` for the sender thread; their reports reach the callback from the poll
        thread. Raises :class:`RefusedError` once the producer failed for good."""
        if self._numbered.refused is not None:
            raise self._numbered.refused
        with self._lock:
            self._numbered.number(records)
            if not self._outgoing:
                self._wake.set()
            self._outgoing.extend(records)

    def begin_term(self) -> None:
        """Nothing to do: no child whose loss failed a key's records."""

    def close(self, timeout: float) -> None:
        """Produce what is queued, flush (bounded by ``timeout``) and fail what is left."""
        with self._lock:
            self._closing = timeout
            self._wake.set()
        self._sender.join()

    def _send_loop(self) -> None:
        produce = self._relay.loop.produce
        while True:
            self._wake.wait()
            with self._lock:
                batch, self._outgoing = self._outgoing, []
                first = self._numbered.next - len(batch)
                closing = self._closing
                self._wake.clear()
            if batch:
                try:
                    produce(*columns(first, batch, self._placing))
                except Exception as exc:
                    # A record librdkafka cannot take (a header of another type, say): the loop
                    # produced none of the batch, which fails (never left unreported).
                    log.exception("produce_failed", records=len(batch))
                    self._fail(range(first, first + len(batch)), str(exc))
            if closing is not None:
                self._relay.close(closing)
                return

    def _poll_failed(self, error: BaseException) -> None:
        """Nothing would report any more: every record not reported fails, and so does the next
        publish (the engine stops leading; the records stay in the outbox)."""
        log.error("producer_poll_failed", error=repr(error))
        self._numbered.refused = RefusedError(f"the producer's poll thread failed: {error!r}")
        with self._lock:
            self._fail(list(self._numbered.pending), f"the producer's poll thread failed: {error!r}")

    def _fail(self, numbers: Sequence[int], reason: str) -> None:
        pending = self._numbered.pending
        for seq in numbers:
            record = pending.pop(seq, None)
            if record is not None:
                self._numbered.report((record, DeliveryError(KafkaError(KafkaError._FAIL, reason))))


class PlacingNativePublisher(NativePublisher):
    """A :class:`NativePublisher` of records that may have a timestamp or partition of their own
    (:class:`~harvester.core.records.PlacedRecord`): its columns carry them, which the others' need not."""

    _placing = True

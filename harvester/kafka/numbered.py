"""Records numbered in publish order until a :class:`~harvester.kafka.loop.Loop` reports on them:
the columns a batch is produced from, and a report applied to the records it names. The publishers
that drive a loop share it, in a child process (:mod:`harvester.kafka.process_publisher`) or in the
harvester's own (:mod:`harvester.kafka.native_publisher`)."""

from __future__ import annotations

import logging
from collections.abc import Callable, Sequence
from typing import Any

from confluent_kafka import KafkaError

from harvester.core.identity import Stamp
from harvester.core.protocols import DeliveryCallback, RefusedError
from harvester.core.records import MarkedRecord, placement
from harvester.kafka.loop import Report
from harvester.kafka.publisher import DeliveryError, refusal


class Numbered:
    """The records sent and not reported yet, by number, and what the reports say of them: each
    acknowledged or failed record goes to ``on_delivery`` once; librdkafka's logs and errors to the
    ``logger`` and ``error_cb`` the configuration named. The caller guards numbering with its lock;
    reports come from one thread."""

    def __init__(
        self,
        on_delivery: DeliveryCallback,
        logger: logging.Logger | None,
        error_cb: Callable[[KafkaError], None] | None,
    ) -> None:
        self.pending: dict[int, MarkedRecord] = {}  # sent or about to be, by number
        self.next = 0  # the number of the next record
        self.refused: RefusedError | None = None  # the producer's fatal error, once it had one
        self.report, self._logger, self._error_cb = on_delivery, logger, error_cb

    def number(self, records: Sequence[MarkedRecord]) -> None:
        """Number ``records`` from :attr:`next` on."""
        seq, pending = self.next, self.pending
        for record in records:
            pending[seq] = record
            seq += 1
        self.next = seq

    def apply(self, frame: Report) -> None:
        """Report the records ``frame`` names (each once: a number already reported is skipped)."""
        acked, failed, logs, errors, for_good = frame
        report, pending = self.report, self.pending
        if for_good and self.refused is None:  # before the records it failed: they report it
            self.refused = refusal(KafkaError(for_good[0][0], for_good[0][1], fatal=True))
        for seq in acked:
            record = pending.pop(seq, None)
            if record is not None:
                report((record, None))
        for seq, code, reason in failed:
            record = pending.pop(seq, None)
            if record is not None:
                report((record, self.refused or DeliveryError(KafkaError(code, reason), record.topic)))
        if self._logger is not None:
            for level, text in logs:
                self._logger.log(level, "%s", text)
        if self._error_cb is not None:
            for code, reason, fatal in errors:
                self._error_cb(KafkaError(code, reason, fatal=fatal))


# What Loop.produce takes: the first number, then topics, keys, values, headers, ids, stamps, placements.
Columns = tuple[
    int,
    list[str],
    list[str],
    list[bytes | None],
    list[Any],
    list[int],
    list[Stamp | None],
    list[tuple[int, int]] | None,
]


def columns(first: int, batch: Sequence[MarkedRecord], placing: bool) -> Columns:
    """The arguments of :meth:`~harvester.kafka.loop.Loop.produce` for ``batch``, numbered from
    ``first`` on; with ``placing``, each record's placement (:func:`~harvester.core.records.placement`)."""
    return (
        first,
        [r.topic for r in batch],
        [r.key for r in batch],
        [r.value for r in batch],
        [r.headers for r in batch],
        [r.id for r in batch],
        [r.stamp for r in batch],
        [placement(r) for r in batch] if placing else None,
    )

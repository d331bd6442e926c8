"""A librdkafka producer fed batches as columns, its delivery reports taken in bulk: the
:class:`Loop` that the producer process (:mod:`harvester.kafka.producer_process`) and the native
publisher in the harvester's own process (:mod:`harvester.kafka.native_publisher`) drive, and the
:class:`Relay` that polls it on a thread of its own and hands its reports on.

The native loop (:mod:`harvester.kafka._rdkafka_loop`, C over the librdkafka of confluent-kafka's
wheel) is there where ``./dev.sh`` or the image built it; :func:`native_loop` makes one. It imports
nothing but the standard library and :mod:`harvester.core.identity`, so that the producer process
starts in a tenth of a second.
"""

from __future__ import annotations

import threading
from collections.abc import Callable
from typing import Any, Protocol

from harvester.core.identity import Stamp

# A report frame: (acked seqs, [(seq, code, reason)], [(level, text)], [(code, reason, fatal)], [(code, reason)]).
Report = tuple[
    list[int], list[tuple[int, int, str]], list[tuple[int, str]], list[tuple[int, str, bool]], list[tuple[int, str]]
]


class Loop(Protocol):
    """A producer fed the frames' columns, its reports taken in bulk: the native loop
    (:mod:`harvester.kafka._rdkafka_loop`) or the producer process's loop in Python."""

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
        /,
    ) -> None:
        """Produce a batch, in order, the records numbered from ``first`` on; a record refused at
        once is reported failed."""

    def poll(self, timeout: float, /) -> None:
        """Serve librdkafka's callbacks for up to ``timeout`` seconds."""

    def take(self) -> Report | None:
        """What was reported since the last call, as a report frame; None for nothing."""

    def flush(self, timeout: float, /) -> int:
        """Wait up to ``timeout`` seconds for the queue to empty; how many records are left."""

    def purge(self) -> None:
        """Drop what is queued or in flight: it comes back failed at the next poll or flush."""


class SettingsError(Exception):
    """librdkafka refused the producer's settings: ``args`` are its code and reason."""


def _texts(settings: dict[str, Any]) -> list[tuple[str, str | None]]:
    """The settings as confluent-kafka hands them to librdkafka: each value's ``str`` (librdkafka
    reads "True" as true), None for the setting's default, and a ``default.topic.config`` dict's own
    settings among the others."""
    out: list[tuple[str, str | None]] = []
    for name, value in settings.items():
        if name == "default.topic.config" and isinstance(value, dict):
            out.extend(_texts(value))
        else:
            out.append((name, None if value is None else str(value)))
    return out


def native_loop(
    settings: dict[str, Any], forward_logs: bool, forward_errors: bool, exit_when_orphaned: bool = True
) -> Loop | None:
    """The native loop over a producer with ``settings`` (None where it was not built); raises
    :class:`SettingsError` when librdkafka refuses them. ``exit_when_orphaned``: a producer process
    ends itself, rather than wait on a full queue, once its harvester is gone."""
    try:
        from harvester.kafka import _rdkafka_loop
    except ImportError:
        return None
    try:
        return _rdkafka_loop.Loop(_texts(settings), forward_logs, forward_errors, exit_when_orphaned)
    except _rdkafka_loop.SettingsError as exc:
        raise SettingsError(*exc.args) from None


class Relay:
    """A loop's reports handed to ``report`` while it runs, from a poll thread, and at the close.
    Should polling fail, ``failed`` is called with the error on the poll thread, which ends."""

    def __init__(self, loop: Loop, report: Callable[[Report], None], failed: Callable[[BaseException], None]) -> None:
        self.loop = loop
        self._report, self._failed = report, failed
        self._stopping = threading.Event()
        self._poller = threading.Thread(target=self._poll, name="producer-poll", daemon=True)

    def start(self) -> None:
        self._poller.start()

    def _poll(self) -> None:
        try:
            while not self._stopping.is_set():
                self.loop.poll(0.05)
                self.report()
        except BaseException as exc:
            self._failed(exc)

    def report(self) -> None:
        """Hand on what was reported since the last call, if anything."""
        frame = self.loop.take()
        if frame is not None:
            self._report(frame)

    def close(self, timeout: float) -> None:
        """Flush (bounded), fail what is left, and hand on the last reports."""
        self._stopping.set()
        self._poller.join()
        if self.loop.flush(timeout):
            self.loop.purge()
            self.loop.flush(0)
        self.report()

"""The reaper's signal handler: a second SIGTERM/SIGINT exits at once, even one that lands while the
first handler is inside ``stop.set()`` (before the flag is set, holding the event's lock: handled as
a first signal, it would wait for that lock in the same thread for ever)."""

from __future__ import annotations

import os
import signal
import threading

import pytest

from harvester.daemon import run


class _ExitError(Exception):
    pass


def test_a_signal_landing_inside_the_first_ones_stop_exits(monkeypatch: pytest.MonkeyPatch) -> None:
    exits: list[int] = []

    def fake_exit(code: int) -> None:
        exits.append(code)
        raise _ExitError

    monkeypatch.setattr(os, "_exit", fake_exit)
    monkeypatch.setattr(os, "write", lambda _fd, data: len(data))
    signals = run.Signals()

    class ReenteredEvent(threading.Event):
        """The second signal arrives within set(), before the flag is set."""

        def set(self) -> None:
            if not exits:
                signals._handle(signal.SIGINT, None)
            super().set()

    signals.stop = ReenteredEvent()
    with pytest.raises(_ExitError):
        signals._handle(signal.SIGTERM, None)
    assert exits == [128 + signal.SIGINT]
    assert signals.received == signal.SIGTERM


def test_the_first_signal_asks_for_a_graceful_stop() -> None:
    signals = run.Signals()
    signals._handle(signal.SIGTERM, None)
    assert signals.stop.is_set()
    assert signals.received == signal.SIGTERM

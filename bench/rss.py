"""Resident memory of a relay's processes over a run, from /proc: each process's peak (``VmHWM``)
is reset to its current size at the run's start (``clear_refs``, Linux 4.0+) and read at its end.

The in-process harvester's processes are this benchmark's process and its live children (the log
source's producer process): their sum also holds what the benchmark itself keeps (its Kafka
consumer counting the topic, the modules it imported), the same in every round; what earlier runs
in the process freed is handed back to the system (``malloc_trim``) before the start is taken. A sum of peaks is
an upper bound of the peak of the sum.
"""

from __future__ import annotations

import contextlib
import ctypes
import os
from collections.abc import Callable
from pathlib import Path

from cpu import own_children


def _status_kib(pid: int, field: str) -> int:
    """A ``kB`` field of /proc/PID/status (0 once the process is gone)."""
    try:
        lines = Path(f"/proc/{pid}/status").read_text().splitlines()
    except OSError:
        return 0
    for line in lines:
        if line.startswith(field + ":"):
            return int(line.split()[1])
    return 0


def own_pids() -> list[int]:
    """This process and its live children (cpu.own_children): the harvester in-process with its
    producer process."""
    return [os.getpid(), *own_children()]


class PeakRss:
    """``PeakRss(pids)``: from now on, the peak resident memory of the processes ``pids()`` lists
    (MiB, summed; asked again at the end, so a process started meanwhile counts with its whole
    life's peak); ``resident`` is their sum when it started. ``exact`` is False where the kernel did
    not let the peak be reset (then ``peak()`` is each process's peak since it started)."""

    def __init__(self, pids: Callable[[], list[int]]) -> None:
        self._pids = pids
        started = pids()
        if os.getpid() in started:
            _trim()
        self.exact = all(_reset(pid) for pid in started)
        self.resident = sum(_status_kib(pid, "VmRSS") for pid in started) / 1024

    def peak(self) -> float:
        return sum(_status_kib(pid, "VmHWM") for pid in self._pids()) / 1024


def _reset(pid: int) -> bool:
    try:
        Path(f"/proc/{pid}/clear_refs").write_text("5")  # 5: reset the peak resident size
    except OSError:
        return False
    return True


def _trim() -> None:
    """Hand this process's freed heap back to the system (glibc's malloc_trim), so that what earlier
    runs in this process freed is not counted as the next relay's resident memory."""
    with contextlib.suppress(OSError, AttributeError):
        ctypes.CDLL("libc.so.6").malloc_trim(0)

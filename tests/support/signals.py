"""Signals handed to a thread of a process other than its main one: the kernel may deliver a
process's signal to any thread that does not block it, and a process must still act on it."""

from __future__ import annotations

import os
import signal
from pathlib import Path


def signal_off_main(pid: int, sig: signal.Signals) -> None:
    """Send ``sig`` to process ``pid`` through one of its threads other than the main one that does
    not block ``sig`` (Linux's kill() with a thread's id prefers that thread as the receiver);
    AssertionError when every other thread blocks ``sig``."""
    bit = 1 << (sig - 1)
    for task in sorted(Path(f"/proc/{pid}/task").iterdir()):
        try:
            status = (task / "status").read_text()
        except FileNotFoundError:  # a thread that ended meanwhile
            continue
        blocked = int(next(line.split()[1] for line in status.splitlines() if line.startswith("SigBlk:")), 16)
        if int(task.name) != pid and not blocked & bit:
            os.kill(int(task.name), sig)
            return
    raise AssertionError(f"every thread of {pid} but its main one blocks {sig.name}")

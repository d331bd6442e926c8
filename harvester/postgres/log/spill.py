"""Where the log source keeps a large transaction's messages beyond its memory limit: an unnamed
temporary file, read back by position.

The leader holds a transaction's outbox messages from its first streamed block to its commit, and a
received transaction's until all its records are done (a new pass hands them out again from there).
A transaction larger than the memory the reaper has would otherwise kill every leader that reads
it, one after another, with the slot stuck before it; so would several large ones at once. So the
transactions of a store hold their messages in memory up to the ``logTransactionMemory`` setting,
all together (a :class:`Budget`, as estimated from their sizes, below), and a large one's later
messages, as they came, in a :class:`Spill`: what a crash loses of it, the slot sends again, so the
file is unnamed (``tempfile.TemporaryFile``, in the ``logSpillDirectory`` setting's directory or the
system's temporary one) and goes with the process. :func:`spill_directory` checks at start that a file
can be made there, so that a directory that is missing or read-only (a container's read-only root)
is a configuration error rather than a leader failing in the middle of a large transaction.
"""

from __future__ import annotations

import os
import tempfile
from array import array
from typing import IO

# What holding a message costs in memory besides its bytes: the bytes object's header and the list's
# slot; or, for a record decoded from it as it came (streamed.py), the record's objects (640 bytes
# measured for an insert of a 100-byte value, a message of about 140: docs/log-source.md "Memory").
MESSAGE_COST = 80
DECODED_COST = 500
# What a transaction holds in memory before it may spill: one that holds less never does, so that
# small transactions get no file each (how many are held at once, the read-ahead bounds).
FLOOR = 64 << 10
_PREFIX = "harvester-spill-"


def spill_directory(directory: str | None) -> str:
    """The directory spill files go to: ``directory``, or the system's temporary directory (``TMPDIR``,
    then ``/tmp`` and the like) when None, once a file was made there and removed; :class:`ValueError`
    saying why not."""
    try:
        where = directory if directory is not None else tempfile.gettempdir()
    except FileNotFoundError as exc:  # no candidate of the system's list takes a file
        raise ValueError(f"not set, and {exc.strerror}: set it to a writable directory") from None
    try:
        with tempfile.TemporaryFile(prefix=_PREFIX, dir=where):
            pass
    except OSError as exc:
        raise ValueError(f"cannot make a file in {where}: {exc.strerror or exc}") from None
    return where


class Budget:
    """The memory (estimated) the transactions of one store may hold, all together. Those streamed
    in progress are counted by their stream (:class:`~harvester.postgres.log.streamed.StreamedTransactions`,
    ``streamed``) and those received by their receiver (:class:`~harvester.postgres.log.transactions.Transactions`,
    ``received``), each side writing only its own count, under its own lock; a committed streamed
    transaction's count passes from one to the other through ``handed`` (both sides run in the
    thread that reads the stream). A transaction holding more than ``floor`` spills its next
    messages once it and the others (as they stood at its stream block's start or its Begin) hold
    more than ``limit``, to a :class:`Spill` in ``directory`` (None: the system's temporary directory)."""

    __slots__ = ("directory", "floor", "handed", "limit", "received", "streamed")

    def __init__(self, limit: int = 1 << 62, floor: int = FLOOR, directory: str | None = None) -> None:
        self.directory = directory
        self.limit = limit
        self.floor = min(limit, floor)
        self.streamed = 0
        self.received = 0
        self.handed = 0

    def room(self, holding: int) -> int:
        """How much a transaction that holds ``holding`` (counted already) may hold before it spills:
        what the others leave of the limit, and at least the floor."""
        others = self.streamed + self.received + self.handed - holding
        return max(self.floor, self.limit - others)

    def spill(self) -> Spill:
        """A new spill file, in the budget's directory."""
        return Spill(self.directory)


class Spill:
    """Messages in a temporary file, by position: appended in order, read back by index, cut back
    to a length (a subtransaction's abort). Not thread-safe; its owner serializes the calls."""

    __slots__ = ("_file", "_starts")

    def __init__(self, directory: str | None = None) -> None:
        """``directory``: where the file is made (None: the system's temporary directory)."""
        self._file: IO[bytes] = tempfile.TemporaryFile(prefix=_PREFIX, dir=directory)  # noqa: SIM115 (closed by close())
        self._starts = array("q", [0])  # where each message starts, and where the next one will

    def __len__(self) -> int:
        return len(self._starts) - 1

    def append(self, message: bytes) -> None:
        self._file.write(message)
        self._starts.append(self._starts[-1] + len(message))

    def read(self, start: int, stop: int) -> list[bytes]:
        """The messages from position ``start`` to ``stop`` (excluded), in one read."""
        if not 0 <= start <= stop <= len(self):
            raise IndexError((start, stop))
        self._file.flush()
        starts, first = self._starts, self._starts[start]
        data = os.pread(self._file.fileno(), starts[stop] - first, first)
        return [data[starts[i] - first : starts[i + 1] - first] for i in range(start, stop)]

    def truncate(self, length: int) -> None:
        """Forget the messages from position ``length`` on."""
        del self._starts[length + 1 :]
        self._file.flush()
        self._file.truncate(self._starts[-1])
        self._file.seek(self._starts[-1])

    def close(self) -> None:
        self._file.close()

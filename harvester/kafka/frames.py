"""Length-prefixed pickled frames over a pipe between the harvester and its producer process
(:mod:`harvester.kafka.process_publisher`). Both ends are this package, so pickle's trust is the
pipe's: a private pair of file descriptors between a parent and the child it started."""

from __future__ import annotations

import pickle
from typing import Any, BinaryIO

_HEADER = 4  # bytes of big-endian length before each frame


def send(stream: BinaryIO, frame: object) -> None:
    """Write ``frame`` whole and flush it."""
    data = pickle.dumps(frame, protocol=pickle.HIGHEST_PROTOCOL)
    stream.write(len(data).to_bytes(_HEADER, "big"))
    stream.write(data)
    stream.flush()


def receive(stream: BinaryIO) -> Any:
    """The next frame, or None at the end of the stream (the other end closed or exited)."""
    header = stream.read(_HEADER)
    if len(header) < _HEADER:
        return None
    size = int.from_bytes(header, "big")
    data = stream.read(size)
    if len(data) < size:
        return None
    return pickle.loads(data)

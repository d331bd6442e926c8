# The native decoder's interface (harvester/postgres/log/_usual_insert.c), for the type checker.
from collections.abc import Callable
from datetime import datetime

from harvester.core.records import MarkedRecord

class Decoder:
    def __init__(
        self, record: Callable[..., MarkedRecord], no_headers: bytes, jsonb: bool, epoch: datetime
    ) -> None: ...
    def decode(self, message: bytes, /) -> MarkedRecord | None: ...
    def take_streamed(
        self,
        raw: list[bytes | memoryview],
        start: int,
        head: int,
        xid: bytes,
        oid: bytes,
        changes: list[object],
        room: int,
        cost: int,
        /,
    ) -> tuple[int, int]: ...

# The native loop's interface (harvester/kafka/_rdkafka_loop.c), for the type checker.
from typing import Any

from harvester.core.identity import Stamp
from harvester.kafka.loop import Report

class SettingsError(Exception): ...

class Loop:
    def __init__(
        self,
        settings: list[tuple[str, str | None]],
        forward_logs: bool,
        forward_errors: bool,
        exit_when_orphaned: bool = True,
    ) -> None: ...
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
    ) -> None: ...
    def poll(self, timeout: float, /) -> None: ...
    def take(self) -> Report | None: ...
    def flush(self, timeout: float, /) -> int: ...
    def purge(self) -> None: ...

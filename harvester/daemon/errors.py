"""How a reaper command fails: one line on stderr, never a traceback, and an exit code."""

from __future__ import annotations

from harvester.daemon.logs import REDACTOR


class FailError(Exception):
    """Stop with a one-line message and an exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def one_line(text: str) -> str:
    """``text`` on one line, with every known secret redacted."""
    return " ".join(REDACTOR.text(str(text)).split())

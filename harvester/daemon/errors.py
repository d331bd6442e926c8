"""How a reaper command fails: one line on stderr, never a traceback, and an exit code."""

from __future__ import annotations

import argparse
from typing import NoReturn

from harvester.daemon.logs import REDACTOR


class FailError(Exception):
    """Stop with a one-line message and an exit code."""

    def __init__(self, message: str, code: int = 2) -> None:
        super().__init__(message)
        self.code = code


def one_line(text: str) -> str:
    """``text`` on one line, with every known secret redacted."""
    return " ".join(REDACTOR.text(str(text)).split())


class OneLineParser(argparse.ArgumentParser):
    """An argument parser whose mistakes are one line on stderr and exit 2, like every other
    reaper mistake (argparse's own prints the usage first); ``--help`` still prints the usage."""

    def error(self, message: str) -> NoReturn:
        self.exit(2, f"{self.prog}: error: {' '.join(message.split())} (see '{self.prog} --help')\n")

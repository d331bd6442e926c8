"""Logging for the ``reaper``: structlog over the standard library, with secrets redacted everywhere.

Every line, from structlog or from a plain ``logging`` logger (libraries), passes one formatter that
adds the instance name and, while this instance leads, the leader id; turns exceptions into text;
redacts secrets; and renders JSON lines (not a terminal) or readable console output (a terminal).

Redaction has two layers: the literal secret values the configuration holds (see
:func:`harvester.daemon.settings.secret_values`), and patterns for secrets the configuration never saw
(``password=...`` in a DSN, ``user:password@`` in a URL, ``sasl.password=...``).
"""

from __future__ import annotations

import json
import logging
import re
import sys
import threading
import time
from collections.abc import Callable, Iterable
from types import TracebackType
from typing import TYPE_CHECKING, Any, TextIO

import structlog
from structlog.typing import EventDict, Processor, WrappedLogger

if TYPE_CHECKING:
    from confluent_kafka import KafkaError

REDACTED = "***"

# password=secret | password='se cret' | "sasl.password": "x" | sasl.password=x | ssl.key.password: x
_KEYED = re.compile(
    r"""(?P<key>\b(?:[\w.]*password|[\w.]*secret)\b["']?\s*(?:=|:[ \t]*))"""
    r"""(?P<value>'(?:[^'\\]|\\.)*'|"(?:[^"\\]|\\.)*"|[^\s,;}&"']+)""",
    re.IGNORECASE,
)
# A mapping key naming a secret (a Kafka property map, a parsed DSN): its value is redacted whole.
SECRET_NAME = re.compile(r"password|secret|\.pem$|jaas|oauthbearer\.config", re.IGNORECASE)
"""Names of configuration keys whose values are secrets (Kafka properties, DSN keys)."""
# scheme://user:password@host
_USERINFO = re.compile(r"(?P<prefix>\b[a-z][a-z0-9+.-]*://[^:/@\s]*:)(?P<value>[^@\s/]+)(?=@)", re.IGNORECASE)

_LEVELS = {
    "all": logging.DEBUG,
    "trace": logging.DEBUG,
    "debug": logging.DEBUG,
    "info": logging.INFO,
    "warn": logging.WARNING,
    "warning": logging.WARNING,
    "error": logging.ERROR,
    "critical": logging.CRITICAL,
    "off": logging.CRITICAL + 10,
}


class Redactor:
    """Replaces secrets in text; thread-safe, shared by every log line and error message."""

    def __init__(self, secrets: Iterable[str] = ()) -> None:
        self._lock = threading.Lock()
        self._secrets: set[str] = set()
        self._literal: re.Pattern[str] | None = None
        self.add(*secrets)

    def add(self, *secrets: str) -> None:
        """Redact these values from now on (empty strings are ignored)."""
        with self._lock:
            for s in secrets:
                if s:
                    self._secrets.add(s)
                    # A secret inside a JSON string or a repr() is escaped; redact those spellings too.
                    self._secrets.add(json.dumps(s)[1:-1])
                    self._secrets.add(repr(s)[1:-1])
            ordered = sorted(self._secrets, key=len, reverse=True)
            self._literal = re.compile("|".join(map(re.escape, ordered))) if ordered else None

    def text(self, value: str) -> str:
        """``value`` with every known secret and every secret-looking pattern replaced."""
        literal = self._literal
        if literal is not None:
            value = literal.sub(REDACTED, value)
        value = _USERINFO.sub(lambda m: m.group("prefix") + REDACTED, value)
        return _KEYED.sub(lambda m: m.group("key") + REDACTED, value)

    def value(self, value: Any) -> Any:
        """Redact strings inside ``value`` (recursively through dicts, lists and tuples)."""
        if isinstance(value, str):
            return self.text(value)
        if isinstance(value, dict):
            return {k: REDACTED if SECRET_NAME.search(str(k)) else self.value(v) for k, v in value.items()}
        if isinstance(value, list | tuple):
            return [self.value(v) for v in value]
        if value is None or isinstance(value, bool | int | float):
            return value
        # Anything else (exceptions, UUIDs, objects) is rendered as text first, then redacted.
        return self.text(str(value))


REDACTOR = Redactor()
"""The process-wide redactor the log pipeline and the CLI's error output use."""


class _Identity:
    """What every line carries: the instance name, and the leader id while this instance leads."""

    def __init__(self) -> None:
        self.instance: str | None = None
        self.leader_id: str | None = None

    def __call__(self, _logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
        if self.instance is not None:
            event_dict.setdefault("instance", self.instance)
        leader = self.leader_id
        if leader is not None:
            event_dict.setdefault("leader_id", leader)
        return event_dict


_IDENTITY = _Identity()
_installed: list[logging.Handler] = []


def set_leader(leader_id: object | None) -> None:
    """Bind (or, with ``None``, unbind) the leader id carried by every following line."""
    _IDENTITY.leader_id = None if leader_id is None else str(leader_id)


def _redact(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> EventDict:
    return {k: REDACTOR.value(v) for k, v in event_dict.items()}


_FIRST = ("timestamp", "level", "event", "logger", "instance", "leader_id")


def _json_renderer(_logger: WrappedLogger, _name: str, event_dict: EventDict) -> str:
    # The fixed keys first, so a human scanning raw JSON lines finds them in the same place.
    ordered = {k: event_dict[k] for k in _FIRST if k in event_dict}
    ordered.update(event_dict)
    return json.dumps(ordered, default=str, ensure_ascii=False)


def level_number(name: str) -> int:
    """The ``logging`` level for a configured level name (goharvest's names included)."""
    return _LEVELS[name.lower()]


def configure(
    level: str = "info",
    fmt: str = "auto",
    instance: str | None = None,
    secrets: Iterable[str] = (),
    stream: TextIO | None = None,
) -> None:
    """Route structlog and standard ``logging`` through one redacting formatter on ``stream``.

    ``fmt`` is ``json``, ``console`` or ``auto`` (console on a terminal, JSON otherwise).
    """
    out = stream if stream is not None else sys.stderr
    REDACTOR.add(*secrets)
    _IDENTITY.instance = instance
    _IDENTITY.leader_id = None
    tty = out.isatty()
    console = fmt == "console" or (fmt == "auto" and tty)
    renderer: Processor = structlog.dev.ConsoleRenderer(colors=tty) if console else _json_renderer
    shared: list[Processor] = [
        structlog.contextvars.merge_contextvars,
        structlog.stdlib.add_log_level,
        structlog.stdlib.add_logger_name,
        structlog.processors.TimeStamper(fmt="iso", utc=True),
        _IDENTITY,
    ]
    formatter = structlog.stdlib.ProcessorFormatter(
        foreign_pre_chain=[structlog.stdlib.ExtraAdder(), *shared],
        processors=[
            structlog.stdlib.ProcessorFormatter.remove_processors_meta,
            # Exceptions become text before redaction, so their messages are redacted too.
            structlog.processors.format_exc_info,
            _redact,
            renderer,
        ],
    )
    handler = logging.StreamHandler(out)
    handler.setFormatter(formatter)
    root = logging.getLogger()
    while _installed:  # reconfiguring: replace our own handler, leave others' (e.g. pytest's) alone
        root.removeHandler(_installed.pop())
    _installed.append(handler)
    root.addHandler(handler)
    # Uncaught exceptions, in any thread, become redacted log lines instead of raw tracebacks.
    sys.excepthook = _log_uncaught
    threading.excepthook = _log_uncaught_in_thread
    root.setLevel(level_number(level))
    structlog.configure(
        processors=[
            structlog.stdlib.filter_by_level,
            *shared,
            structlog.processors.StackInfoRenderer(),
            structlog.stdlib.ProcessorFormatter.wrap_for_formatter,
        ],
        logger_factory=structlog.stdlib.LoggerFactory(),
        wrapper_class=structlog.stdlib.BoundLogger,
        cache_logger_on_first_use=False,
    )


class Folder:
    """Lets a message through once per ``window`` seconds: librdkafka repeats a failure (a broker it
    cannot reach) on every reconnect. Repeats, told apart only by librdkafka's timings and counts, are
    counted, and the count goes with the next one let through."""

    _TIMINGS = re.compile(r"\(after \d+ms in state \w+(, \d+ identical error\(s\) suppressed)?\)")

    def __init__(self, window: float = 60.0) -> None:
        self._window = window
        self._seen: dict[str, tuple[float, int]] = {}  # text -> (when let through, repeats since)

    def admit(self, text: str) -> int | None:
        """None for a repeat within the window (drop it); else the repeats folded since the last one."""
        key, now = self._TIMINGS.sub("", text), time.monotonic()
        seen = self._seen.get(key)
        if seen is not None and now - seen[0] < self._window:
            self._seen[key] = (seen[0], seen[1] + 1)
            return None
        if len(self._seen) > 1000:  # forget messages not seen for a window
            self._seen = {k: v for k, v in self._seen.items() if now - v[0] < self._window}
        self._seen[key] = (now, 0)
        return seen[1] if seen is not None else 0


# Broker answers librdkafka waits out by itself, which a cluster just started gives every new client
# once (the coordinator that hands out producer ids still loading its topic): information, not a
# warning.
_LOADING = ("Coordinator load in progress", "Coordinator not available")


class FoldRepeats(logging.Filter):
    """A :class:`Folder` over the lines of a logger; a line let through after repeats says how many.
    A retry of a coordinator still loading is logged at info level."""

    def __init__(self) -> None:
        super().__init__()
        self.folder = Folder()

    def filter(self, record: logging.LogRecord) -> bool:
        text = record.getMessage()
        if record.levelno == logging.WARNING and text.endswith(": retrying") and any(m in text for m in _LOADING):
            record.levelno, record.levelname = logging.INFO, "INFO"
            if not logging.getLogger(record.name).isEnabledFor(logging.INFO):
                return False
        folded = self.folder.admit(text)
        if folded:
            record.msg, record.args = f"{text} ({folded} repeat(s) folded)", ()
        return folded is not None


def librdkafka_logger() -> logging.Logger:
    """The logger librdkafka's clients are given (their ``logger`` property), repeats folded."""
    logger = logging.getLogger("rdkafka")
    if not any(isinstance(f, FoldRepeats) for f in logger.filters):
        logger.addFilter(FoldRepeats())
    return logger


def librdkafka_error_cb(**labels: str) -> Callable[[KafkaError], None]:
    """librdkafka's error callback (its ``error_cb`` property): ``kafka_error`` with the error's text,
    not its repr, repeats folded; a warning (librdkafka retries it by itself) unless fatal. ``labels``
    go on each line (the outbox: the callback runs on whichever thread polls the client)."""
    folder, log = Folder(), structlog.get_logger("rdkafka").bind(**labels)

    def on_error(error: KafkaError) -> None:
        text = str(error.str())
        folded = folder.admit(text)
        if folded is None:
            return
        extra = {"repeats_folded": folded} if folded else {}
        (log.error if error.fatal() else log.warning)("kafka_error", error=text, code=error.name(), **extra)

    return on_error


def _log_uncaught(exc_type: type[BaseException], exc: BaseException, tb: TracebackType | None) -> None:
    logging.getLogger("reaper").critical("uncaught_exception", exc_info=(exc_type, exc, tb))


def _log_uncaught_in_thread(args: threading.ExceptHookArgs) -> None:
    if args.exc_value is None:
        return
    name = args.thread.name if args.thread is not None else "?"
    logging.getLogger("reaper").error(
        "uncaught_exception_in_thread %s", name, exc_info=(args.exc_type, args.exc_value, args.exc_traceback)
    )


def reset() -> None:
    """Undo :func:`configure`: structlog's defaults again and no handler of ours on the root logger."""
    root = logging.getLogger()
    while _installed:
        root.removeHandler(_installed.pop())
    sys.excepthook = sys.__excepthook__
    threading.excepthook = threading.__excepthook__
    structlog.reset_defaults()
    _IDENTITY.instance = _IDENTITY.leader_id = None

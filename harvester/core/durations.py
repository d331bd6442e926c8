"""Go-style duration strings (``100ms``, ``5s``, ``1m30s``) as used in goharvest configuration."""

from __future__ import annotations

import re
from datetime import timedelta

_UNIT_SECONDS = {"ns": 1e-9, "us": 1e-6, "µs": 1e-6, "ms": 1e-3, "s": 1.0, "m": 60.0, "h": 3600.0}
_TERM = re.compile(r"(\d+(?:\.\d+)?)(ns|us|µs|ms|s|m|h)")


def parse_duration(value: object) -> timedelta:
    """Parse a duration: a Go duration string, a number of seconds, or a ``timedelta``.

    Raises ``ValueError`` with a readable message for anything else, including negative values.
    """
    if isinstance(value, timedelta):
        seconds = value.total_seconds()
    elif isinstance(value, bool):
        raise ValueError(f"invalid duration {value!r}")
    elif isinstance(value, int | float):
        seconds = float(value)
    elif isinstance(value, str):
        text = value.strip()
        if text in ("0", ""):
            seconds = 0.0
        else:
            pos, seconds = 0, 0.0
            for m in _TERM.finditer(text):
                if m.start() != pos:
                    break
                seconds += float(m.group(1)) * _UNIT_SECONDS[m.group(2)]
                pos = m.end()
            if pos != len(text) or pos == 0:
                raise ValueError(f"invalid duration {value!r}: use forms like '100ms', '5s', '1m30s'")
    else:
        raise ValueError(f"invalid duration {value!r}")
    if seconds < 0:
        raise ValueError(f"duration {value!r} must not be negative")
    return timedelta(seconds=seconds)

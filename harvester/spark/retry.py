"""The driver's and the tasks' calls to the outbox retried as a reaper retries its statements."""

from __future__ import annotations

import time
from collections.abc import Callable
from typing import TypeVar

from harvester.core.protocols import FencedError, ShardCountError, StoreError

T = TypeVar("T")

# A broken connection (a restarted or failed-over server, a terminated backend) is re-opened by the
# store's next call: the driver retries a term start, plan or purge (all idempotent) a few times
# before the query fails, as a reaper backs off and retries. A fence is final.
_RETRY_PAUSES = (0.5, 2.0, 5.0)


def retrying(call: Callable[[], T]) -> T:
    """``call()``, retried after :class:`StoreError` (not after a fence) a few times."""
    for pause in _RETRY_PAUSES:
        try:
            return call()
        except (FencedError, ShardCountError):
            raise
        except StoreError:
            time.sleep(pause)
    return call()

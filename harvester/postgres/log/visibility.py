"""Whether transactions the log source received are visible to new snapshots yet.

The walsender sends a transaction once its commit record is flushed, a moment before the committing
session makes it visible. A purge in that moment would delete none of its rows, yet count its
records done, and the slot would move past rows left in the table for good: so a transaction goes
out only once one statement finds it visible (:meth:`harvester.postgres.log.store.LogStore.mark`).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence
from typing import Any

from harvester.postgres.log.transactions import Transaction

# How many of the given transactions a new snapshot does not see yet (their 32-bit xids made 64-bit
# against the snapshot's xmax: a decoded transaction is at most one wraparound behind it).
_INVISIBLE = (
    "SELECT count(*) FROM txid_current_snapshot() AS s, unnest(%s::bigint[]) AS x WHERE NOT txid_visible_in_snapshot("
    "txid_snapshot_xmax(s) - ((txid_snapshot_xmax(s) - x) %% 4294967296 + 4294967296) %% 4294967296, s)"
)
# A transaction not visible yet is checked again 5 and 20 ms later within a mark; after that, the
# idle engine marks again this often until it is.
_VISIBLE_PAUSE = 0.005
INVISIBLE_RECHECK = 0.05

Run = Callable[[str, Sequence[Any]], list[tuple[Any, ...]]]


def visible(run: Run, transactions: set[Transaction]) -> bool:
    """Whether the rows of ``transactions`` are visible to new snapshots (asked through ``run``, a
    store's statement runner); marks them so when they are."""
    if not transactions:
        return True
    xids = [txn.xid for txn in transactions]
    for pause in (0.0, _VISIBLE_PAUSE, _VISIBLE_PAUSE * 4):
        time.sleep(pause)
        if not int(run(_INVISIBLE, (xids,))[0][0]):
            for txn in transactions:
                txn.visible = True
            return True
    return False

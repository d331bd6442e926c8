"""Process-wide settings for a process whose main job is harvesting. The reaper applies them as it
starts; an application that embeds a :class:`harvester.Harvester` may call
:func:`tune_garbage_collector` too, knowing that it changes the whole process.

CPython (3.11 to 3.13) collects its youngest generation every 700 net allocations of container
objects, and an older one every tenth time. A harvester keeps tens of thousands of records alive
under a backlog (received transactions, per-key FIFOs, records in flight), so it allocates far ahead
of what it frees, and the collector ran hundreds of collections per 100,000 records that found next
to nothing (the records are freed by reference counting; they form no cycles). ``docs/reaper.md``
has the figures and the command.
"""

from __future__ import annotations

import gc

# Young collections every 50,000 net allocations, middle every 20 of those, full every 100 of those
# (and, as always in CPython, only once the long-lived objects grew by a quarter).
GC_THRESHOLDS = (50_000, 20, 100)


def tune_garbage_collector() -> None:
    """Freeze what start-up made (modules, settings: never garbage, and skipped by every collection
    from now on) and raise the collector's thresholds to :data:`GC_THRESHOLDS`."""
    gc.collect()  # what is garbage now would stay, once frozen
    gc.freeze()
    gc.set_threshold(*GC_THRESHOLDS)

"""A micro-batch's end offset, per shard: the ids it planned, the fence epoch it planned them under
and a batch counter (:mod:`harvester.spark.drain.reader` says why offsets name records).

Spark writes every batch's offset to the checkpoint's offset log before the batch runs, keeps the
last hundred (``spark.sql.streaming.minBatchesToRetain``), and hands it between the JVM and the
source's Python runner as JSON. So the ids are packed: the differences between consecutive ids as
64-bit little-endian integers, deflated, in base64 (``"packed"``): 10,000 dense ids (a backlog's)
take 650 bytes where their list took about 70 KB, and about 1.4 bytes an id when shards interleave
them. Offsets written before (a plain ``"ids"`` list) are read as they are.
"""

from __future__ import annotations

import base64
import sys
import zlib
from array import array
from collections.abc import Mapping, Sequence
from itertools import accumulate, pairwise
from typing import Any

Offset = dict[str, Any]

_BIG_ENDIAN = sys.byteorder == "big"  # a checkpoint may be read on another machine: packed little-endian


def shard_part(epoch: int, batch: int, ids: Sequence[int]) -> Offset:
    """One shard's part of an end offset."""
    part: Offset = {"epoch": epoch, "batch": batch}
    if ids:
        deltas = array("q", [ids[0]])
        deltas.extend(b - a for a, b in pairwise(ids))
        if _BIG_ENDIAN:
            deltas.byteswap()
        part["packed"] = base64.b64encode(zlib.compress(deltas.tobytes(), 1)).decode("ascii")
    else:
        part["ids"] = []
    return part


def planned_ids(part: Mapping[str, Any]) -> list[int]:
    """The ids one shard's part of an offset planned (packed, or a list in older checkpoints)."""
    packed = part.get("packed")
    if packed is None:
        return [int(i) for i in part.get("ids", ())]
    deltas = array("q")
    deltas.frombytes(zlib.decompress(base64.b64decode(packed)))
    if _BIG_ENDIAN:
        deltas.byteswap()
    return list(accumulate(deltas))


def shard_offset(offset: Mapping[str, Any], shard: int) -> Offset:
    """``shard``'s part of ``offset`` (nothing planned yet when it has none)."""
    found = offset.get(str(shard))
    return dict(found) if isinstance(found, Mapping) else {"epoch": 0, "batch": 0, "ids": []}

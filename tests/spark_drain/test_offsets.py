"""A micro-batch's planned ids, packed into its offset and read back; older offsets' plain lists."""

from __future__ import annotations

import json
import random

from harvester.spark.drain.offsets import planned_ids, shard_offset, shard_part


def test_planned_ids_come_back_from_the_packed_offset_as_json_carries_it() -> None:
    dense = list(range(1_000, 11_000))
    scattered = sorted(random.Random(7).sample(range(1, 40_000), 10_000))
    for ids in (dense, scattered, [5], []):
        part = json.loads(json.dumps(shard_part(3, 4, ids)))
        assert (planned_ids(part), part["epoch"], part["batch"]) == (ids, 3, 4)
    assert len(json.dumps(shard_part(3, 4, dense))) < 1_000  # a dense backlog's batch is small


def test_an_offset_written_before_packing_is_read_as_it_is() -> None:
    offset = {"shards": 2, "0": {"epoch": 1, "batch": 2, "ids": [4, 9]}}
    assert planned_ids(shard_offset(offset, 0)) == [4, 9]
    assert planned_ids(shard_offset(offset, 1)) == []  # nothing planned yet

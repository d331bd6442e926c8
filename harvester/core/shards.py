"""Which shard a record belongs to: a stable hash of its ``kafka_key``, reduced modulo the number of
shards. Every record of a key belongs to the same shard, so per-key order holds within a shard.

The hash is the first 32 bits of the key's MD5 (of its UTF-8 bytes; a NULL key hashes as the
empty one), read as an unsigned number. MD5 is not used for security here: it is an immutable
function in PostgreSQL (so an expression index can hold it, :mod:`harvester.postgres.schema.sharding`)
and computes the same value in Python, Spark or any client, on every version. PostgreSQL's own
``hashtextextended`` is cheaper but would need a port of its internal hash to every client.
"""

from __future__ import annotations

import hashlib


def shard_of(key: str | bytes | None, shards: int) -> int:
    """The shard (0 to ``shards`` - 1) of records with ``key``; the same as the mark query's."""
    if shards < 1:
        raise ValueError("shards must be at least 1")
    data = key.encode("utf-8") if isinstance(key, str) else key or b""
    return int.from_bytes(hashlib.md5(data, usedforsecurity=False).digest()[:4], "big") % shards

"""The outbox's tables and what is stored in them: migrations and their ledger, the table's shape,
names, the fence rows, the shard index, dead letters, the table-less outbox's payload format."""

"""The log source: the store that reads the outbox's inserts (or a table-less outbox's messages)
from a logical replication slot instead of marking (docs/log-source.md)."""

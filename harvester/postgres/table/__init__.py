"""The polling source: the store that marks the outbox table's rows, purges and resets them under
the epoch fence (docs/architecture.md, "A record's path")."""

"""The PostgreSQL adapter, in three rooms: :mod:`.schema` (the outbox's tables: migrations, catalog,
fence, dead letters), :mod:`.table` (the polling source, which marks, purges and resets under the
epoch fence) and :mod:`.log` (the log source, which reads a logical replication slot). Beside them,
what all three use: a store's connections (:mod:`.connections`, :mod:`.deadline`)."""

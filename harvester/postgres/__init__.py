"""The PostgreSQL adapter: the outbox's schema (migrations, catalog), the store that marks, purges
and resets under the epoch fence, and the dead-letter table."""

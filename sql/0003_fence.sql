-- Zombie fencing: one row per outbox table. A new leader bumps the epoch (row-locked); every mark,
-- purge and reset checks its own epoch against this row under a share lock, so once a bump has
-- committed no statement of an older epoch changes the outbox.
CREATE TABLE IF NOT EXISTS ${fence} (
  outbox_table TEXT PRIMARY KEY,
  epoch        BIGINT NOT NULL,
  leader_id    UUID,
  acquired_at  TIMESTAMPTZ NOT NULL DEFAULT now()
);

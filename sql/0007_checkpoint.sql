-- Exactly-once mode: where a new leader starts re-reading the checkpoint topic (the offset after
-- the last checkpoint whose records are known to be purged).
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS checkpoint_position BIGINT NOT NULL DEFAULT 0;

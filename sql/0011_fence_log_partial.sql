-- The log source without per-batch deletes: how much of the first transaction not all done is
-- done, stored with log_lsn: the leading log_partial_count records of the transaction whose commit
-- record starts at log_partial_lsn. A new leader skips them too, so a crash repeats only what its
-- predecessor had not stored done, and that is at most a few records of each key.
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS log_partial_lsn BIGINT NOT NULL DEFAULT 0;
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS log_partial_count BIGINT NOT NULL DEFAULT 0;

-- The log source over a table whose replication slot was lost or invalidated: the highest id the
-- recovery still harvests from the table as mark-purge does (-1: the new slot may not exist yet, its
-- head is taken once it does; 0: no recovery under way). Kept in the fence row so that a leader that
-- takes over from one that died mid-recovery finishes it before streaming the new slot.
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS log_recovery_id BIGINT NOT NULL DEFAULT 0;

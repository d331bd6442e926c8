-- The log source without per-batch deletes (a table-less outbox, or a table with a retention
-- window): the end of the last transaction whose records are all done, stored under the epoch
-- fence before the slot is confirmed there. A new leader skips everything up to it, whether or not
-- the slot's confirmation reached the server.
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS log_lsn BIGINT NOT NULL DEFAULT 0;
-- Retention window: a cut is the oldest transaction id still running at a moment (pending_xmin)
-- and the end of the log just after (pending_lsn). Once log_lsn reaches pending_lsn, every row
-- whose inserting transaction is older than pending_xmin was delivered: the cut becomes
-- delivered_xmin, and the leader deletes those rows in bulk once they are past the window.
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS log_pending_xmin BIGINT NOT NULL DEFAULT 0;
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS log_pending_lsn BIGINT NOT NULL DEFAULT 0;
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS log_delivered_xmin BIGINT NOT NULL DEFAULT 0;

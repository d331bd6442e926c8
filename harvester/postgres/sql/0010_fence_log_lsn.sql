-- Table-less outbox (log source reading logical messages): the end of the last transaction whose
-- records are all done, stored under the epoch fence before the slot is confirmed there. A new
-- leader skips everything up to it, whether or not the slot's confirmation reached the server.
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS log_lsn BIGINT NOT NULL DEFAULT 0;

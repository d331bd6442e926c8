-- Delivery attempts of records that failed permanently, so the count survives a failover. Optional:
-- without these columns the harvester counts attempts in memory. Adding a column with a constant
-- default rewrites nothing in PostgreSQL 11+.
ALTER TABLE ${table} ADD COLUMN IF NOT EXISTS harvest_attempts INT NOT NULL DEFAULT 0;
ALTER TABLE ${table} ADD COLUMN IF NOT EXISTS harvest_first_failure TIMESTAMPTZ;
ALTER TABLE ${table} ADD COLUMN IF NOT EXISTS harvest_last_error TEXT;

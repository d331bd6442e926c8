-- Sharded harvesting: one fence row per (outbox table, shard), each recording how many shards its
-- reapers agreed on. A row from before becomes shard 0 of 1, so a single-shard outbox keeps its
-- epoch. The fence table is shared by a schema's outbox tables: the key changes only once.
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS shard INT NOT NULL DEFAULT 0;
ALTER TABLE ${fence} ADD COLUMN IF NOT EXISTS shards INT NOT NULL DEFAULT 1;
DO $do$
DECLARE
  pkey TEXT;
BEGIN
  SELECT c.conname INTO pkey FROM pg_constraint c
    WHERE c.conrelid = ${fence_literal}::regclass AND c.contype = 'p' AND array_length(c.conkey, 1) = 1;
  IF pkey IS NOT NULL THEN
    EXECUTE format('ALTER TABLE %s DROP CONSTRAINT %I, ADD PRIMARY KEY (outbox_table, shard)', ${fence_literal}, pkey);
  END IF;
END
$do$;

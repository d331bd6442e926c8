-- Spark sink (harvester.spark): executors stage rows here, the driver moves one attempt per
-- partition into ${table} in a single transaction. The data source also runs this file on demand,
-- so every statement must stay idempotent.
--
-- One row per Spark task attempt that staged rows; (write_id, partition_id, attempt) names the
-- attempt, task_id is the compact tag its staged rows carry.
CREATE TABLE IF NOT EXISTS ${spark_tasks} (
  task_id      BIGSERIAL PRIMARY KEY,
  write_id     UUID NOT NULL,
  partition_id INT NOT NULL,
  attempt      INT NOT NULL,
  started_at   TIMESTAMPTZ NOT NULL DEFAULT now()
);
CREATE INDEX IF NOT EXISTS ${spark_tasks_write_idx} ON ${spark_tasks} (write_id);
-- Unlogged: staged rows are worthless after a crash (the job is retried), so they skip the WAL.
-- No index either, so that the executors' COPY stays cheap; the commit reads it in one scan.
-- seq is partition_id * 2^40 + row number within the partition, so ORDER BY seq is DataFrame order.
-- A NULL topic stands for the write's constant topic, NULL headers for none: neither is copied.
CREATE UNLOGGED TABLE IF NOT EXISTS ${spark_staging} (
  task_id       BIGINT NOT NULL,
  seq           BIGINT NOT NULL,
  sort_number   BIGINT,
  sort_text     TEXT COLLATE "C",
  kafka_topic   TEXT,
  kafka_key     TEXT NOT NULL,
  value_text    TEXT,
  value_bytes   BYTEA,
  header_keys   TEXT[],
  header_values TEXT[]
);
-- Micro-batches already committed per streaming sink: a replayed batch id is skipped.
CREATE TABLE IF NOT EXISTS ${spark_commits} (
  sink_id      TEXT NOT NULL,
  batch_id     BIGINT NOT NULL,
  records      BIGINT NOT NULL,
  committed_at TIMESTAMPTZ NOT NULL DEFAULT now(),
  PRIMARY KEY (sink_id, batch_id)
);

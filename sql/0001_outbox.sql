-- The outbox table, column for column the goharvest layout, so existing tables work unchanged.
-- Created only when absent: an existing table (with BYTEA, TEXT or JSONB values) is left as it is.
CREATE TABLE IF NOT EXISTS ${table} (
  id                  BIGSERIAL PRIMARY KEY,
  create_time         TIMESTAMPTZ NOT NULL DEFAULT now(),
  kafka_topic         VARCHAR(249) NOT NULL,
  kafka_key           VARCHAR(100) NOT NULL,
  kafka_value         VARCHAR(10000),
  kafka_header_keys   TEXT[] NOT NULL DEFAULT '{}',
  kafka_header_values TEXT[] NOT NULL DEFAULT '{}',
  leader_id           UUID
);

-- Dead letters: records given up after max_attempts, with their full content (same column types
-- as the outbox), why, how often, when, and which leader and epoch gave up. id is the outbox id.
CREATE TABLE IF NOT EXISTS ${dead_letter} (
  id                  BIGINT PRIMARY KEY,
  create_time         TIMESTAMPTZ NOT NULL,
  kafka_topic         TEXT NOT NULL,
  kafka_key           TEXT,
  kafka_value         ${value_type},
  kafka_header_keys   TEXT[],
  kafka_header_values TEXT[],
  reason              TEXT NOT NULL,
  error               TEXT NOT NULL,
  attempts            INT NOT NULL,
  first_failure       TIMESTAMPTZ NOT NULL,
  last_failure        TIMESTAMPTZ NOT NULL,
  epoch               BIGINT NOT NULL,
  leader_id           UUID,
  dead_lettered_at    TIMESTAMPTZ NOT NULL DEFAULT now()
);

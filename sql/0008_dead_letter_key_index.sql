-- With dead_letter_policy=hold_key the mark query skips keys that have a dead letter.
CREATE INDEX IF NOT EXISTS ${dead_letter_key_index} ON ${dead_letter} (kafka_key);

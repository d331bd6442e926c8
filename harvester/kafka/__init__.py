"""The Kafka adapter: publishing (one record at a time, or in transactions with checkpoints) and
the topics the harvester needs."""

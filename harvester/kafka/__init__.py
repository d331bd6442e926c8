"""The Kafka adapter: publishing (a delivery report per record, or in transactions with checkpoints)
and the topics the harvester needs."""

"""The engine core: mark-purge/reset against small protocols (:mod:`.protocols`), with one
dispatcher per delivery mode. Nothing here imports PostgreSQL, Kafka or Spark code."""

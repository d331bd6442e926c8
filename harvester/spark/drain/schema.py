"""What the ``outbox`` streaming source yields: the drained records, or, when its tasks publish
them (``option("publish", "true")``), one row per task saying what it published."""

from __future__ import annotations

from pyspark.sql.pandas.types import to_arrow_schema
from pyspark.sql.types import ArrayType, BinaryType, IntegerType, LongType, StringType, StructField, StructType

# The columns Spark's Kafka sink reads (topic, key, value, headers, partition), the record's outbox id
# and the term it is delivered under.
DRAIN_SCHEMA = StructType(
    [
        StructField("topic", StringType(), False),
        StructField("key", StringType(), True),
        StructField("value", BinaryType(), True),
        StructField(
            "headers",
            ArrayType(
                StructType([StructField("key", StringType(), False), StructField("value", BinaryType(), True)]),
                False,
            ),
            False,
        ),
        StructField("id", LongType(), False),
        # The partition a reaper would choose (harvester.spark.drain.placement); null without Kafka options.
        StructField("partition", IntegerType(), True),
        # The shard's term when the batch was handed out, under which the outbox-publish sink
        # dead-letters: the epoch in the headers is the one the batch was planned under, older
        # when a restarted query replays it.
        StructField("term", LongType(), False),
    ]
)

# The same schema as Arrow, as Spark checks a batch the reader yields against it.
DRAIN_ARROW_SCHEMA = to_arrow_schema(DRAIN_SCHEMA, timezone="UTC")

# One row per task that published its shard's records (its keys of them, with tasksPerShard): the
# shard's term it dead-lettered under, how many records it read, and how many of them Kafka refused
# for good and it moved to the dead-letter table (the rest are in Kafka).
PUBLISHED_SCHEMA = StructType(
    [
        StructField("shard", IntegerType(), False),
        StructField("batch", LongType(), False),
        StructField("term", LongType(), False),
        StructField("records", LongType(), False),
        StructField("dead_lettered", LongType(), False),
    ]
)

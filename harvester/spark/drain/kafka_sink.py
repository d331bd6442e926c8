"""Spark's Kafka sink refuses the drain's rows unless they carry their ``partition`` column.

Left to itself, Spark's Kafka sink places a keyed record by Java's murmur2 of the key, a reaper's
producer by librdkafka's crc32. A query that writes the drain's rows to Spark's Kafka sink without
the ``partition`` column the drain fills in (``placement.py``) puts a key's records into another
partition than a reaper sharing the outbox does, and a consumer loses their order across a handover,
silently. :func:`install` (called by ``register``) makes ``DataStreamWriter.start`` of classic
PySpark and of the Spark Connect client refuse such a query before it starts, with one line, unless
the writer sets :data:`ACCEPT_OPTION`. A JVM rule would see every plan, but it would need a jar and
a ``spark.sql.extensions`` setting that a job can forget; this check comes with ``register``, which
every job reading the ``outbox`` source calls.
"""

from __future__ import annotations

import functools
import re
from collections.abc import Callable, Mapping
from typing import Any

from harvester.spark.drain.options import DrainConfigError

ACCEPT_OPTION = "outbox.acceptSparkPartitioner"
"""A writer option: ``true`` accepts Spark's own placement of the drain's rows (e.g. a topic that a
reaper never writes)."""

SOURCE = "outbox"


class KafkaPartitionError(DrainConfigError):
    """A query writes the drain's rows to Spark's Kafka sink without their ``partition`` column."""


def check(
    sink_format: str | None, options: Mapping[str, str], reads_outbox: bool, columns: Callable[[], list[str]]
) -> None:
    """Raise :class:`KafkaPartitionError` for a query whose sink is Spark's Kafka sink, whose input
    reads the ``outbox`` source and whose rows have no ``partition`` column, unless acknowledged."""
    if (sink_format or "").lower() != "kafka" or not reads_outbox:
        return
    accepted = {k.lower(): v for k, v in options.items()}.get(ACCEPT_OPTION.lower(), "")
    if accepted.strip().lower() == "true" or "partition" in columns():
        return
    raise KafkaPartitionError(
        "writeStream.format('kafka') over the outbox source without its 'partition' column: Spark would place"
        " keys by murmur2, not where a reaper does, and lose per-key order across a handover; select"
        f" 'partition' (with kafka.bootstrap.servers on the source), use format('outbox-publish'), or set"
        f" option {ACCEPT_OPTION}=true"
    )


def _classic_reads_outbox(jdf: Any) -> bool:
    """Whether a classic DataFrame's plan has a streaming relation of the ``outbox`` source."""
    leaves = jdf.queryExecution().logical().collectLeaves().iterator()
    while leaves.hasNext():
        leaf = leaves.next()
        if leaf.getClass().getSimpleName() == "StreamingRelationV2" and leaf.sourceName() == SOURCE:
            return True
    return False


def _private(jobject: Any, name: str) -> Any:
    """A private field of a JVM object (the classic writer keeps its format and options there)."""
    field = jobject.getClass().getDeclaredField(name)
    field.setAccessible(True)
    return field.get(jobject)


def _classic_options(jwrite: Any) -> dict[str, str]:
    found = {}
    entries = _private(jwrite, "extraOptions").iterator()
    while entries.hasNext():
        entry = entries.next()
        found[str(entry._1())] = str(entry._2())
    return found


# The named arguments of ``start`` (classic) and ``_start_internal`` (Connect) besides ``format``: the
# rest are writer options.
_START_ARGUMENTS = frozenset({"path", "tableName", "outputMode", "partitionBy", "queryName"})
_CONNECT_READ = re.compile(r'data_source\s*\{\s*format:\s*"' + SOURCE + r'"')


def _given(options: Mapping[str, Any], given: Mapping[str, Any]) -> dict[str, str]:
    """The writer's options and those given to ``start`` itself."""
    return {**{str(k): str(v) for k, v in options.items()}, **{k: str(v) for k, v in given.items() if v is not None}}


def _guard_classic(start: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(start)
    def guarded(self: Any, path: str | None = None, format: str | None = None, *args: Any, **kwargs: Any) -> Any:
        options = {k: v for k, v in kwargs.items() if k not in _START_ARGUMENTS}
        check(
            format or _private(self._jwrite, "source"),
            _given(_classic_options(self._jwrite), options),
            _classic_reads_outbox(self._df._jdf),
            lambda: list(self._df.columns),
        )
        return start(self, path, format, *args, **kwargs)

    return guarded


def _guard_connect(start: Callable[..., Any]) -> Callable[..., Any]:
    @functools.wraps(start)
    def guarded(self: Any, format: str | None = None, **kwargs: Any) -> Any:
        from pyspark.sql.connect.dataframe import DataFrame

        options = {k: v for k, v in kwargs.items() if k not in _START_ARGUMENTS}
        plan, session = self._write_stream._child, self._session
        described = str(plan.plan(session.client))  # the input relation's protobuf, as text
        check(
            format or self._write_proto.format,
            _given(self._write_proto.options, options),
            bool(_CONNECT_READ.search(described)) and "is_streaming: true" in described,
            lambda: list(DataFrame(plan, session).columns),
        )
        return start(self, format=format, **kwargs)

    return guarded


def install() -> None:
    """Guard ``DataStreamWriter.start`` of classic PySpark and, when its client is installed, of Spark
    Connect (once per process)."""
    from pyspark.sql.streaming.readwriter import DataStreamWriter

    if not getattr(DataStreamWriter.start, "_outbox_guard", False):
        DataStreamWriter.start = _guard_classic(DataStreamWriter.start)  # type: ignore[method-assign]
        DataStreamWriter.start._outbox_guard = True  # type: ignore[attr-defined]
    try:
        from pyspark.sql.connect.streaming.readwriter import DataStreamWriter as ConnectWriter
    except ImportError:  # the Connect client's extra is not installed: no Connect queries either
        return
    if not getattr(ConnectWriter._start_internal, "_outbox_guard", False):
        ConnectWriter._start_internal = _guard_connect(ConnectWriter._start_internal)  # type: ignore[method-assign]
        ConnectWriter._start_internal._outbox_guard = True  # type: ignore[attr-defined]

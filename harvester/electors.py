"""The leader election a :class:`~harvester.harvester.Harvester` runs: the NELI settings its config
implies, the default elector, and what an elector of several shards offers besides the protocol."""

from __future__ import annotations

from collections.abc import Callable, Mapping
from typing import TYPE_CHECKING, Protocol, runtime_checkable

from harvester.config import HarvesterConfig
from harvester.core.protocols import Elector

if TYPE_CHECKING:
    from leader import ElectorConfig, LeaderStatus


def elector_config(config: HarvesterConfig) -> ElectorConfig:
    """The NELI settings ``config`` implies; raises ``pydantic.ValidationError`` when its limits do
    not fit together (no I/O: ``reaper check`` runs it too)."""
    from leader import ElectorConfig

    limits = config.limits
    return ElectorConfig(
        kafka_config=dict(config.base_kafka_config),
        group_id=config.group_id,
        topic=config.topic,
        heartbeat_timeout=limits.heartbeat_timeout.total_seconds(),
        min_poll_interval=limits.min_poll_interval.total_seconds(),
        max_poll_interval=limits.max_poll_interval.total_seconds(),
        name=config.name,
        partitions=config.shards,
    )


def neli_elector(
    config: HarvesterConfig,
    report: Callable[[int], Mapping[str, float]] | None = None,
    healthy: Callable[[], bool] | None = None,
) -> Elector:
    """The default elector: Fast NELI over the configured leader group and topic; its heartbeats
    carry ``report`` of their shard, and it steps down while ``healthy`` says no."""
    from leader import NeliElector

    return NeliElector(elector_config(config), report=report, healthy=healthy)


@runtime_checkable
class ShardedElector(Elector, Protocol):
    """An elector of several shards (NELI over a topic of several partitions)."""

    def status_of(self, shard: int) -> LeaderStatus:
        """The view of shard ``shard``'s leadership."""
        ...

"""goharvest's example configurations, written anew with their settings: examples/reaper.yaml (also its
README's) runs (tests/compat/test_writers.py drains an outbox with it); examples/reaper_secure.yaml is
refused in one line naming ``leaderTopic`` and the fix, and validates once that line is fixed (its SASL
broker is not one the suite runs). A ``maxPollInterval`` under the election's session timeout
(goharvest's default is half of ``heartbeatTimeout``) is raised to it, with a warning."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from harvester.compose import elector_config, raised_max_poll_interval
from harvester.config import HarvesterConfig
from harvester.daemon.check import validate_election
from harvester.daemon.cli import main
from harvester.daemon.loading import load

pytestmark = pytest.mark.unit

SECURE = """\
harvest:
  baseKafkaConfig:
    bootstrap.servers: localhost:9094
    security.protocol: sasl_ssl
    ssl.ca.location: ca-cert.pem
    sasl.mechanism: SCRAM-SHA-512
    sasl.username: alice
    sasl.password: alice-secret
  leaderTopic: __consumer_offsets
  leaderGroupID: my-app-name
  dataSource: host=localhost port=5432 user=postgres password= dbname=postgres sslmode=disable
  outboxTable: outbox
logging:
  level: Debug
"""


def test_secure_example_is_refused_for_its_internal_leader_topic_then_validates_fixed(
    tmp_path: Path, capsys: pytest.CaptureFixture[str]
) -> None:
    config = tmp_path / "reaper.yaml"
    config.write_text(SECURE)
    assert main(["-f", str(config)]) == 2  # goharvest's command line: run
    refused = capsys.readouterr()
    assert refused.out == ""
    (line,) = refused.err.splitlines()
    assert "harvest.leaderTopic: __consumer_offsets is Kafka's internal topic" in line
    assert "leaderTopic: <leaderGroupID>.neli" in line  # the fix
    assert "alice-secret" not in line
    # Fixed as the line says, the rest of the file stands: SASL/SSL settings, goharvest's data source.
    config.write_text(SECURE.replace("__consumer_offsets", "my-app-name.neli"))
    settings = load(config, environ={})
    validate_election(settings)
    assert settings.harvest.topic == "my-app-name.neli"
    assert settings.harvest.base_kafka_config["sasl.mechanism"] == "SCRAM-SHA-512"


@pytest.mark.parametrize(
    ("limits", "used"),
    [
        ({"heartbeatTimeout": "5s", "maxPollInterval": "2500ms"}, 10.0),  # goharvest's default, written out
        ({"minPollInterval": "1s", "maxPollInterval": "1s"}, 10.0),  # goharvest: at least minPollInterval
        ({"maxPollInterval": "10s"}, 10.0),
        ({}, 300.0),  # this project's default: 5m
    ],
)
def test_short_max_poll_interval_is_raised_to_the_session_timeout(limits: dict[str, str], used: float) -> None:
    config = HarvesterConfig.model_validate({"leaderGroupID": "g", "limits": limits})
    assert elector_config(config).max_poll_interval == used
    configured = config.limits.max_poll_interval
    assert (raised_max_poll_interval(config) is not None) == (configured < timedelta(seconds=10))

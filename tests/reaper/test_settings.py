"""reaper.yaml: goharvest compatibility, defaults, environment overrides, secret references, errors."""

from __future__ import annotations

from datetime import timedelta
from pathlib import Path

import pytest

from harvester.daemon.loading import load
from harvester.daemon.settings import ReaperSettings, SettingsError, defaulted_connections, secret_values

pytestmark = pytest.mark.unit

# Every key goharvest's reaper.yaml knows, spelled as goharvest spells them.
GOHARVEST_YAML = (Path(__file__).parent / "data" / "goharvest-reaper.yaml").read_text()

SNAKE_YAML = """\
harvest:
  base_kafka_config:
    bootstrap.servers: kafka-1:9092,kafka-2:9092
  producer_kafka_config:
    compression.type: zstd
    delivery.timeout.ms: 15000
  leader_topic: orders-reaper.neli
  leader_group_id: orders-reaper
  data_source: host=orders-db port=5433 user=orders password= dbname=orders sslmode=disable
  outbox_table: sales.outbox
  name: reaper-a
  limits:
    min_poll_interval: 250ms
    heartbeat_timeout: 7s
    max_in_flight_records: 2000
    min_metrics_interval: 10s
    send_concurrency: 4
    send_buffer: 20
    queue_timeout: 45s
    mark_backoff: 20ms
    io_error_backoff: 1s
    mark_query_records: 250
logging:
  level: info
"""


def write(tmp_path: Path, text: str, name: str = "reaper.yaml") -> Path:
    path = tmp_path / name
    path.write_text(text)
    return path


def test_goharvest_format_loads_unchanged(tmp_path: Path) -> None:
    s = load(write(tmp_path, GOHARVEST_YAML), environ={})
    h = s.harvest
    assert h.base_kafka_config == {"bootstrap.servers": "kafka-1:9092,kafka-2:9092"}
    assert h.producer_kafka_config == {"compression.type": "zstd", "delivery.timeout.ms": 15000}
    assert (h.topic, h.group_id, h.name) == ("orders-reaper.neli", "orders-reaper", "reaper-a")
    assert h.data_source.startswith("host=orders-db port=5433 user=orders")
    assert (h.table.schema, h.table.name) == ("sales", "outbox")
    lim = h.limits
    assert (lim.min_poll_interval, lim.heartbeat_timeout) == (timedelta(milliseconds=250), timedelta(seconds=7))
    assert (lim.min_metrics_interval, lim.queue_timeout) == (timedelta(seconds=10), timedelta(seconds=45))
    assert (lim.mark_backoff, lim.io_error_backoff) == (timedelta(milliseconds=20), timedelta(seconds=1))
    assert (lim.max_in_flight_records, lim.send_concurrency, lim.send_buffer, lim.mark_query_records) == (
        2000,
        4,
        20,
        250,
    )
    assert s.logging.level == "info"


def test_snake_case_spelling_is_equivalent(tmp_path: Path) -> None:
    camel = load(write(tmp_path, GOHARVEST_YAML, "a.yaml"), environ={})
    snake = load(write(tmp_path, SNAKE_YAML, "b.yaml"), environ={})
    assert camel.harvest.model_dump(exclude={"name"}) == snake.harvest.model_dump(exclude={"name"})


def test_defaults_are_goharvests_documented_defaults() -> None:
    # goharvest README, "Configuration" table (Limits.*), plus Config defaults.
    s = load(None, environ={})
    lim = s.harvest.limits
    assert lim.min_poll_interval == timedelta(milliseconds=100)
    assert lim.heartbeat_timeout == timedelta(seconds=5)
    assert lim.queue_timeout == timedelta(seconds=30)
    assert lim.mark_backoff == timedelta(milliseconds=10)
    assert lim.io_error_backoff == timedelta(milliseconds=500)
    assert lim.max_in_flight_records == "auto"  # goharvest: 1000; see docs/reaper.md
    assert lim.send_concurrency == 8
    assert lim.send_buffer == 10
    assert lim.mark_query_records == "auto"  # goharvest: 100
    assert lim.min_metrics_interval == timedelta(seconds=5)
    assert s.harvest.outbox_table == "outbox"
    assert s.harvest.producer_kafka_config == {}
    assert s.harvest.topic == f"{s.harvest.group_id}.neli"  # LeaderTopic defaults to <LeaderGroupID>.neli


def test_go_durations_and_empty_file(tmp_path: Path) -> None:
    s = load(write(tmp_path, "harvest:\n  limits:\n    queueTimeout: 1m30s\n    markBackoff: 250us\n"), environ={})
    assert s.harvest.limits.queue_timeout == timedelta(seconds=90)
    assert s.harvest.limits.mark_backoff == timedelta(microseconds=250)
    assert load(write(tmp_path, "", "empty.yaml"), environ={}) == load(None, environ={})


def test_environment_overrides_win_over_the_file(tmp_path: Path) -> None:
    env = {
        "REAPER_HARVEST__DATA_SOURCE": "host=db dbname=app",
        "REAPER_HARVEST__LIMITS__MAX_IN_FLIGHT_RECORDS": "5000",
        "REAPER_HARVEST__LIMITS__QUEUETIMEOUT": "2s",  # camelCase names match too, ignoring case
        "REAPER_HARVEST__BASE_KAFKA_CONFIG__SASL_PASSWORD": "pw",
        "REAPER_HARVEST__PRODUCER_KAFKA_CONFIG__DELIVERY_TIMEOUT_MS": "20000",
        "REAPER_LOGGING__LEVEL": "WARN",
        "REAPER_HTTP__PORT": "9191",
        "REAPER_SHUTDOWN__TIMEOUT": "45s",
        "REAPER_CONFIG": "ignored.yaml",  # names the file; not an override
        "UNRELATED": "x",
    }
    s = load(write(tmp_path, GOHARVEST_YAML), environ=env)
    h = s.harvest
    assert h.data_source == "host=db dbname=app"
    assert h.limits.max_in_flight_records == 5000
    assert h.limits.queue_timeout == timedelta(seconds=2)
    assert h.limits.send_buffer == 20  # untouched file values stay
    assert h.base_kafka_config == {"bootstrap.servers": "kafka-1:9092,kafka-2:9092", "sasl.password": "pw"}
    assert h.producer_kafka_config["delivery.timeout.ms"] == "20000"
    assert h.producer_kafka_config["compression.type"] == "zstd"
    assert (s.logging.level, s.http.port, s.shutdown.timeout) == ("warn", 9191, timedelta(seconds=45))


def test_startup_kafka_timeout_is_a_positive_duration() -> None:
    assert load(environ={}).startup.kafka_timeout == timedelta(seconds=30)
    assert load(environ={"REAPER_STARTUP__KAFKA_TIMEOUT": "8s"}).startup.kafka_timeout == timedelta(seconds=8)
    for bad, why in (("0s", "greater than 0 seconds"), ("soon", "invalid duration 'soon'")):
        with pytest.raises(SettingsError) as caught:
            load(environ={"REAPER_STARTUP__KAFKA_TIMEOUT": bad})
        assert str(caught.value).startswith("configuration: REAPER_STARTUP__KAFKA_TIMEOUT (startup.kafka_timeout): ")
        assert why in str(caught.value) and "\n" not in str(caught.value)


def test_secret_references_from_env_and_files(tmp_path: Path) -> None:
    secret = tmp_path / "pgpass"
    secret.write_text("file-S3cret\n")  # the trailing newline of secret files is not part of the secret
    text = (
        "harvest:\n"
        f"  dataSource: host=db user=app password=${{file:{secret}}} dbname=app\n"
        "  baseKafkaConfig:\n"
        "    sasl.password: ${env:KAFKA_PW}\n"
        "    client.id: $${env:LITERAL}\n"
    )
    s = load(write(tmp_path, text), environ={"KAFKA_PW": "env-S3cret"})
    assert s.harvest.data_source == "host=db user=app password=file-S3cret dbname=app"
    assert s.harvest.base_kafka_config["sasl.password"] == "env-S3cret"
    assert s.harvest.base_kafka_config["client.id"] == "${env:LITERAL}"
    assert sorted(secret_values(s)) == ["env-S3cret", "file-S3cret"]


@pytest.mark.parametrize(
    ("dsn", "kafka", "expected"),
    [
        ("host=a user=u password=p1 dbname=d", {"sasl.password": "p2"}, ["p1", "p2"]),
        ("postgresql://u:p3@a/d", {"ssl.key.password": "p4", "sasl.username": "u"}, ["p3", "p4"]),
        ("host=a dbname=d", {}, []),
    ],
)
def test_secret_values(dsn: str, kafka: dict[str, str], expected: list[str]) -> None:
    s = ReaperSettings.model_validate({"harvest": {"dataSource": dsn, "baseKafkaConfig": kafka}})
    assert sorted(secret_values(s)) == expected


BAD = [
    # (file text, environment, words the one-line message must contain)
    ("harvest:\n  outboxTabel: outbox\n", {}, ["harvest.outboxTabel", "unknown key"]),
    ("harvest:\n  limits:\n    queueTimeout: 5 seconds\n", {}, ["harvest.limits.queueTimeout", "invalid duration"]),
    ("harvest:\n  limits:\n    markBackoff: -5ms\n", {}, ["harvest.limits.markBackoff", "duration"]),
    ("harvest:\n  limits:\n    maxInFlightRecords: -1\n", {}, ["harvest.limits.maxInFlightRecords", "or 'auto'"]),
    ("harvest:\n  limits:\n    sendBuffer: -1\n", {}, ["harvest.limits.sendBuffer", "greater"]),
    ("harvest:\n  outboxTable: outbox; DROP TABLE x\n", {}, ["harvest.outboxTable", "invalid table name"]),
    ("harvest:\n  outboxTable: a.b.c\n", {}, ["harvest.outboxTable", "invalid table name"]),
    ("logging:\n  level: loud\n", {}, ["logging.level", "unknown log level"]),
    ("http:\n  port: 70000\n", {}, ["http.port"]),
    ("harvest:\n  baseKafkaConfig:\n    sasl: {password: x}\n", {}, ["harvest.baseKafkaConfig.sasl", "string"]),
    ("harvest:\n  dataSource: host=a password='S3cret\n", {}, ["harvest.dataSource", "connection string"]),
    ("harvest: [\n", {}, ["invalid YAML", "line"]),
    ("- just\n- a list\n", {}, ["top level must be a mapping"]),
    ("metrics:\n  port: 1\n", {}, ["metrics", "unknown key"]),
    ("", {"REAPER_HARVEST__LIMITS__SEND_BUFFER": "-3"}, ["REAPER_HARVEST__LIMITS__SEND_BUFFER", "send_buffer"]),
    ("", {"REAPER_HARVEST__NO_SUCH": "1"}, ["REAPER_HARVEST__NO_SUCH", "unknown setting"]),
    ("", {"REAPER_HARVEST__LIMITS__QUEUE_TIMEOUT": "soon"}, ["REAPER_HARVEST__LIMITS__QUEUE_TIMEOUT", "duration"]),
    ("harvest:\n  dataSource: password=${env:NOPE}\n", {}, ["harvest.dataSource", "NOPE", "not set"]),
    ("harvest:\n  dataSource: password=${file:/nonexistent/pw}\n", {}, ["harvest.dataSource", "/nonexistent/pw"]),
    ("harvest:\n  outboxTable: a\n  outboxTable: b\n", {}, ["invalid YAML at line 3", "'outboxTable' given twice"]),
    ("harvest:\n  outboxTable: a\n  outbox_table: b\n", {}, ["harvest: outbox_table and outboxTable", "same setting"]),
    ("harvest:\n  limits:\n    maxAttempts: 2\n    max_attempts: 3\n", {}, ["limits: max_attempts and maxAttempts"]),
    ("", {"REAPER_HARVEST_OUTBOX_TABLE": "x"}, ["REAPER_HARVEST_OUTBOX_TABLE: unknown setting", "two underscores"]),
]


@pytest.mark.parametrize(("text", "env", "words"), BAD)
def test_bad_configuration_is_one_line_naming_the_field(
    tmp_path: Path, text: str, env: dict[str, str], words: list[str]
) -> None:
    with pytest.raises(SettingsError) as info:
        load(write(tmp_path, text), environ=env)
    message = str(info.value)
    assert "\n" not in message
    assert "S3cret" not in message
    for word in words:
        assert word in message


def test_missing_file_is_reported(tmp_path: Path) -> None:
    with pytest.raises(SettingsError, match="no such configuration file"):
        load(tmp_path / "absent.yaml", environ={})


def test_connection_defaults_are_named_and_carry_no_secret(tmp_path: Path) -> None:
    empty = load(write(tmp_path, ""), environ={})
    assert [d.split(" ")[0] for d in defaulted_connections(empty)] == ["harvest.dataSource", "harvest.baseKafkaConfig"]
    assert "password" not in empty.harvest.data_source
    given = "harvest:\n  dataSource: host=db dbname=app\n  baseKafkaConfig: {bootstrap.servers: 'k:9092'}\n"
    assert defaulted_connections(load(write(tmp_path, given), environ={})) == []
    # An environment override sets a connection as much as the file does.
    assert defaulted_connections(load(None, environ={"REAPER_HARVEST__DATA_SOURCE": "host=db"}))[0].startswith(
        "harvest.baseKafkaConfig"
    )


SECTIONS_YAML = """\
harvest:
  - outboxTable: sales.outbox
    shards: 2
    dataSource: host=db dbname=sales password=S3cret-sales
  - outbox_table: billing.outbox
    leaderGroupID: billing-reaper
    limits:
      maxInFlightRecords: 7
http:
  port: 9191
"""


def test_a_list_of_harvest_sections_loads_each_whole(tmp_path: Path) -> None:
    settings = load(write(tmp_path, SECTIONS_YAML), environ={})
    first, second = settings.harvests
    assert (first.table.qualified, first.shards, first.group_id) == ("sales.outbox", 2, "outbox-harvester.sales.outbox")
    assert (second.table.qualified, second.group_id, second.limits.max_in_flight_records) == (
        "billing.outbox",
        "billing-reaper",
        7,
    )
    assert settings.harvest == first  # the first section, as a one-section file's
    sections = settings.sections
    assert [s.harvests for s in sections] == [(first,), (second,)]
    assert all(s.http.port == 9191 for s in sections)  # the shared sections go with each
    assert "S3cret-sales" in secret_values(settings)


def test_a_single_mapping_is_one_section(tmp_path: Path) -> None:
    settings = load(write(tmp_path, GOHARVEST_YAML), environ={})
    assert settings.sections == (settings,) and settings.harvests == (settings.harvest,)


def test_environment_overrides_address_one_section_or_every_one(tmp_path: Path) -> None:
    env = {"REAPER_HARVEST__1__OUTBOX_TABLE": "other.outbox", "REAPER_HARVEST__NAME": "pod-1"}
    first, second = load(write(tmp_path, SECTIONS_YAML), environ=env).harvests
    assert (first.outbox_table, second.outbox_table) == ("sales.outbox", "other.outbox")
    assert first.name == second.name == "pod-1"


@pytest.mark.parametrize(
    ("sections", "env", "message"),
    [
        (
            "  - outboxTable: public.a\n  - outboxTable: public.a\n",
            {},
            "harvest[1].outboxTable: public.a is already harvest[0]'s; each harvest section needs its own "
            "outbox table, leader group and leader topic",
        ),
        ("  - outboxTable: public.a\n  - outboxTable: a\n", {}, "harvest[1].outboxTable: a is already harvest[0]'s"),
        (
            "  - outboxTable: a\n  - {outboxTable: b, leaderGroupID: outbox-harvester.a}\n",
            {},
            "harvest[1].leaderGroupID: outbox-harvester.a is already harvest[0]'s",
        ),
        ("  - outboxTable: a\n  - outboxTabel: b\n", {}, "harvest[1].outboxTabel: unknown key"),
        ("  - outboxTable: a\n  - {outboxTable: b, shards: 0}\n", {}, "harvest[1].shards:"),
        ("  - outboxTable: a\n", {"REAPER_HARVEST__3__SHARDS": "2"}, "harvest has no section 3 (the file lists 1)"),
        ("  - outboxTable: a\n", {"REAPER_HARVEST__0__SHARDS": "x"}, "REAPER_HARVEST__0__SHARDS (harvest[0].shards)"),
        ("  []\n", {}, "harvest: an empty list"),
    ],
)
def test_section_mistakes_are_one_line_naming_the_section(
    tmp_path: Path, sections: str, env: dict[str, str], message: str
) -> None:
    path = write(tmp_path, "harvest:\n" + sections)
    with pytest.raises(SettingsError) as info:
        load(path, environ=env)
    assert "\n" not in str(info.value)
    assert message in str(info.value)


def test_sections_of_the_same_table_name_in_other_databases_are_allowed(tmp_path: Path) -> None:
    text = (
        "harvest:\n  - {dataSource: 'host=a dbname=x', outboxTable: public.outbox, leaderGroupID: g1}\n"
        "  - {dataSource: 'host=b dbname=x', outboxTable: public.outbox, leaderGroupID: g2}\n"
    )
    assert len(load(write(tmp_path, text), environ={}).harvests) == 2


def test_workers_from_the_file_or_the_environment(tmp_path: Path) -> None:
    path = write(tmp_path, "harvest: {outboxTable: public.outbox}\nworkers: 3\n")
    assert load(path, environ={}).workers == 3
    assert load(path, environ={"REAPER_WORKERS": "2"}).workers == 2
    assert load(write(tmp_path, ""), environ={}).workers == 1  # one process, as before
    with pytest.raises(SettingsError, match="workers"):
        load(write(tmp_path, "workers: 0\n"), environ={})
    with pytest.raises(SettingsError, match="REAPER_HARVEST: unknown setting"):  # a section is not a value
        load(path, environ={"REAPER_HARVEST": "x"})

"""Log output: JSON lines off a terminal, console on one, identity on every line, secrets never shown."""

from __future__ import annotations

import io
import json
import logging
from collections.abc import Iterator

import pytest
import structlog

from harvester.daemon import logs
from harvester.daemon.logs import Redactor

pytestmark = pytest.mark.unit

SECRETS = ["Pg-S3cret!", 'Ka"fka\\S3cret']


class Tty(io.StringIO):
    def isatty(self) -> bool:
        return True


@pytest.fixture
def out() -> Iterator[io.StringIO]:
    stream = io.StringIO()
    logs.configure("debug", "auto", instance="inst-7", secrets=SECRETS, stream=stream)
    yield stream
    logs.set_leader(None)


def lines(stream: io.StringIO) -> list[dict[str, object]]:
    return [json.loads(line) for line in stream.getvalue().splitlines()]


def test_json_lines_carry_instance_and_leader_id(out: io.StringIO) -> None:
    log = structlog.get_logger("t")
    log.info("before")
    logs.set_leader("L-1")
    log.info("during", n=1)
    logging.getLogger("some.library").warning("plain %s", "logging")
    logs.set_leader(None)
    log.info("after")
    got = lines(out)
    assert [g["event"] for g in got] == ["before", "during", "plain logging", "after"]
    assert all(g["instance"] == "inst-7" for g in got)
    assert [g.get("leader_id") for g in got] == [None, "L-1", "L-1", None]
    assert got[1]["n"] == 1 and got[1]["level"] == "info" and "timestamp" in got[1]


def test_secrets_are_redacted_everywhere(out: io.StringIO) -> None:
    log = structlog.get_logger("t")
    log.info(f"connecting with {SECRETS[0]}", dsn=f"host=h password={SECRETS[0]} dbname=d")
    log.info("kafka", config={"sasl.password": SECRETS[1], "bootstrap.servers": "b:9092"})
    log.info("unknown secrets", dsn="host=h password=never-configured", url="postgresql://u:url-pw@h/d")
    log.info("props", text='"ssl.key.password": "quoted-pw", sasl.password=bare-pw')
    try:
        raise RuntimeError(f"login failed for password {SECRETS[1]}")
    except RuntimeError:
        log.exception("failed")
    logging.getLogger("lib").error("lib saw %s", SECRETS[0])
    log.info("dsn", dsn="host=h sslpassword=dsn-key-pw sslmode=verify-full")
    text = out.getvalue()
    unknown = ["never-configured", "url-pw", "quoted-pw", "bare-pw", "dsn-key-pw"]
    for secret in [*SECRETS, json.dumps(SECRETS[1])[1:-1], *unknown]:
        assert secret not in text
    got = lines(out)
    assert got[0]["event"] == "connecting with ***"
    assert got[0]["dsn"] == "host=h password=*** dbname=d"
    assert got[1]["config"] == {"sasl.password": "***", "bootstrap.servers": "b:9092"}
    assert got[2]["url"] == "postgresql://u:***@h/d"
    assert "RuntimeError: login failed for password ***" in str(got[4]["exception"])


def test_tls_and_sasl_secrets_are_redacted_from_librdkafka_debug_output() -> None:
    """The secrets of a SASL_SSL configuration (sasl.password, ssl.key.password, the DSN's sslpassword)
    are known to the redactor, and librdkafka's debug output of every context shows none of them."""
    from confluent_kafka import Producer

    from harvester.daemon.settings import ReaperSettings, secret_values

    sasl, key, dsn_key = "sasl-S3cret", "key-S3cret", "dsn-key-S3cret"
    settings = ReaperSettings.model_validate(
        {
            "harvest": {
                "dataSource": f"host=db user=rt sslmode=verify-full sslpassword={dsn_key}",
                "baseKafkaConfig": {"bootstrap.servers": "127.0.0.1:1", "sasl.password": sasl, "ssl.key.password": key},
            }
        }
    )
    assert {sasl, key, dsn_key} <= set(secret_values(settings))
    stream = io.StringIO()
    logs.configure("debug", "json", secrets=secret_values(settings), stream=stream)
    config = {
        "bootstrap.servers": "127.0.0.1:1",
        "security.protocol": "SASL_SSL",
        "sasl.mechanism": "SCRAM-SHA-512",
        "sasl.username": "rt",
        "sasl.password": sasl,
        "ssl.key.password": key,
        "debug": "all",
        "logger": logs.librdkafka_logger(),
    }
    producer = Producer(config)
    producer.poll(0.5)
    producer.flush(0)
    text = stream.getvalue()
    assert "sasl.password" in text  # the configuration was dumped, its secrets redacted
    for secret in (sasl, key, dsn_key):
        assert secret not in text
    logs.reset()


def test_console_output_on_a_terminal() -> None:
    stream = Tty()
    logs.configure("info", "auto", instance="inst-8", secrets=["Tty-S3cret"], stream=stream)
    structlog.get_logger("t").info("hello", secret="Tty-S3cret")
    structlog.get_logger("t").debug("hidden at info level")
    text = stream.getvalue()
    assert text.count("\n") == 1
    assert "hello" in text and "inst-8" in text and "Tty-S3cret" not in text
    with pytest.raises(json.JSONDecodeError):
        json.loads(text)


@pytest.mark.parametrize(
    ("level", "shown"),
    [("Debug", 3), ("info", 2), ("Warn", 1), ("trace", 3), ("off", 0)],
)
def test_goharvest_level_names(level: str, shown: int) -> None:
    stream = io.StringIO()
    logs.configure(level, "json", stream=stream)
    log = structlog.get_logger("t")
    log.debug("d")
    log.info("i")
    log.warning("w")
    assert len(stream.getvalue().splitlines()) == shown


def test_redactor_handles_nested_values_and_objects() -> None:
    r = Redactor(["abc-123"])
    nested = {"a": ["x abc-123", ("abc-123",)], "n": 1, "b": None}
    assert r.value(nested) == {"a": ["x ***", ["***"]], "n": 1, "b": None}
    assert r.value(ValueError("abc-123 failed")) == "*** failed"
    assert r.text("nothing secret here") == "nothing secret here"
    assert r.text("host=a password= dbname=d") == "host=a password= dbname=d"  # empty password: nothing to hide


def test_uncaught_exceptions_in_threads_are_logged_redacted(out: io.StringIO) -> None:
    import threading

    def boom() -> None:
        raise ValueError(f"thread failed with {SECRETS[0]}")

    thread = threading.Thread(target=boom, name="worker-1")
    thread.start()
    thread.join()
    got = lines(out)
    assert got[-1]["event"] == "uncaught_exception_in_thread worker-1"
    assert "ValueError: thread failed with ***" in str(got[-1]["exception"])
    assert SECRETS[0] not in out.getvalue()


def test_librdkafka_repeats_are_folded(out: io.StringIO) -> None:
    """A broker that refuses connections: librdkafka logs the failure on every reconnect; one line
    goes through per minute, the repeats are counted into the next one."""
    from confluent_kafka import Producer

    from tests.reaper.test_e2e import free_port

    rdkafka = logging.getLogger("rdkafka")
    for f in list(rdkafka.filters):
        rdkafka.removeFilter(f)
    try:
        refused = f"127.0.0.1:{free_port()}"
        producer = Producer(
            {"bootstrap.servers": refused, "logger": logs.librdkafka_logger(), "reconnect.backoff.max.ms": 100}
        )
        for _ in range(30):  # about 3 s of reconnects
            producer.poll(0.1)
        failures = [g for g in lines(out) if "Connection refused" in str(g["event"])]
        assert len(failures) == 1, failures
        # The filter counted the rest: the same line after the window says how many were folded.
        fold = next(f for f in rdkafka.filters if isinstance(f, logs.FoldRepeats))
        assert sum(repeats for _, repeats in fold.folder._seen.values()) >= 1
    finally:
        for f in list(rdkafka.filters):
            rdkafka.removeFilter(f)


@pytest.mark.parametrize("level", ["info", "warning"])
def test_a_coordinator_still_loading_is_information(level: str) -> None:
    """librdkafka retries by itself when the coordinator that hands out producer ids still loads (a
    cluster just started): that line is info, shown only at info level, other warnings stay."""
    stream = io.StringIO()
    logs.configure(level, "json", instance="i", stream=stream)
    rdkafka = logs.librdkafka_logger()
    try:
        rdkafka.warning(
            "GETPID [rdkafka#producer-5] [thrd:main]: Failed to acquire idempotence PID from broker"
            " 127.0.0.1:9092/1: Broker: Coordinator load in progress: retrying"
        )
        rdkafka.warning("FAIL [rdkafka#producer-5] [thrd:b]: 127.0.0.1:9/bootstrap: Connection refused")
        got = [(g["level"], str(g["event"])[:4]) for g in lines(stream)]
        assert got == ([("info", "GETP")] if level == "info" else []) + [("warning", "FAIL")]
    finally:
        for f in list(rdkafka.filters):
            rdkafka.removeFilter(f)

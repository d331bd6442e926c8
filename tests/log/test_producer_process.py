"""The log source's producer in a child process (harvester.kafka.process_publisher), on the real
broker: records land in publish order with one report each, their identity headers after their own;
placed records, tombstones and null header values land as given and a record too large fails alone;
refused settings fail at start as in the harvester's own process; librdkafka's logs and errors reach
the configured logger and callback; a child that dies fails what it left, once each, and the next
records go through a new child, a key with a failed record failing until its retry; a child whose
harvester died exits; a terminal's or service manager's signals leave it to the harvester; the child
imports the harvester's own package whatever the working directory holds."""

from __future__ import annotations

import logging
import os
import queue
import signal
import subprocess
import sys
import time
from collections.abc import Callable, Iterator
from datetime import UTC, datetime
from pathlib import Path
from typing import Any

import pytest
from confluent_kafka import KafkaError, KafkaException

from harvester.core.identity import IdentityHeaders, Stamp
from harvester.core.protocols import DeliveryReport
from harvester.core.records import MarkedRecord, PlacedRecord
from harvester.kafka.native_publisher import NativePublisher
from harvester.kafka.process_publisher import PlacingProcessPublisher, ProcessPublisher, runs_in_child
from harvester.kafka.publisher import DeliveryError, KafkaPublisher, producer_config
from tests.support.kafka import read_messages, text
from tests.support.services import Services

Reports = queue.SimpleQueue[DeliveryReport]


def _record(n: int, topic: str, key: str = "k") -> MarkedRecord:
    return MarkedRecord(n, datetime.now(UTC), topic, key, f"v{n}".encode(), [("h", b"x")])


@pytest.fixture(autouse=True, params=["native", "python"])
def loop(request: pytest.FixtureRequest, monkeypatch: pytest.MonkeyPatch) -> str:
    """Each test runs with the child's native loop and with its pure-Python one."""
    name: str = request.param
    monkeypatch.setenv("HARVESTER_PRODUCER_LOOP", name)
    return name


def _collect(reports: Reports, count: int, timeout: float = 60) -> list[DeliveryReport]:
    return [reports.get(timeout=timeout) for _ in range(count)]


@pytest.fixture
def started(services: Services, loop: str) -> Iterator[Callable[..., tuple[ProcessPublisher, Reports]]]:
    """Starts a producer process, with ``placing`` one whose frames carry placements."""
    made: list[ProcessPublisher] = []

    def start(placing: bool = False, **producer: Any) -> tuple[ProcessPublisher, Reports]:
        reports: Reports = queue.SimpleQueue()
        kind = PlacingProcessPublisher if placing else ProcessPublisher
        publisher = kind(producer_config(services.kafka(), producer), reports.put_nowait, in_order=True)
        assert publisher.loop == loop, "the native loop was not built: see ./dev.sh, .local/native.log"
        made.append(publisher)
        return publisher, reports

    yield start
    for publisher in made:
        publisher.close(5)


def test_records_land_in_publish_order_with_one_report_each(
    started: Callable[..., tuple[ProcessPublisher, Reports]], services: Services, topics: Callable[..., str]
) -> None:
    topic = topics(3)
    publisher, reports = started()
    assert publisher.keeps_order
    for start in range(0, 3000, 250):  # as a dispatcher publishes: what it sends of each mark at once
        publisher.publish([_record(n, topic, key=f"k{n % 7}") for n in range(start, start + 250)])
    done = _collect(reports, 3000)
    assert sorted(r.id for r, _ in done) == list(range(3000))
    assert all(err is None for _, err in done)
    seen: dict[str, list[int]] = {}
    for msg in read_messages(services.bootstrap, [topic], 3000):
        seen.setdefault(text(msg.key()), []).append(int(text(msg.value())[1:]))
        assert msg.headers() == [("h", b"x")]
    assert all(ids == sorted(ids) for ids in seen.values())
    assert sum(len(ids) for ids in seen.values()) == 3000


@pytest.mark.parametrize(
    "kind", [ProcessPublisher, NativePublisher, KafkaPublisher], ids=["producer process", "native", "in process"]
)
def test_a_stamped_record_carries_its_identity_headers_after_its_own(
    services: Services, topics: Callable[..., str], kind: type[ProcessPublisher | NativePublisher | KafkaPublisher]
) -> None:
    """The stores stamp records instead of appending the identity headers; every publisher joins
    them, the producer process on its side of the pipe, the native loop in C."""
    topic = topics(1)
    reports: Reports = queue.SimpleQueue()
    publisher = kind(producer_config(services.kafka(), {}), reports.put_nowait, in_order=True)
    stamp = Stamp.of(IdentityHeaders("x-"), 7, b"p")
    try:
        records = [_record(n, topic) for n in (41, 42)]
        for record in records:
            record.stamp = stamp
        publisher.publish(records)
        assert all(err is None for _, err in _collect(reports, 2))
    finally:
        publisher.close(5)
    got = [msg.headers() for msg in read_messages(services.bootstrap, [topic], 2)]
    assert got == [[("h", b"x"), ("x-id", str(n).encode()), ("x-epoch", b"7"), ("x-producer", b"p")] for n in (41, 42)]


def test_placed_records_tombstones_and_null_header_values_land_as_given_and_a_too_large_record_fails_alone(
    started: Callable[..., tuple[ProcessPublisher, Reports]], services: Services, topics: Callable[..., str]
) -> None:
    topic = topics(3)
    publisher, reports = started(placing=True, **{"message.max.bytes": 10_000})
    when = datetime(2026, 1, 2, 3, 4, 5, tzinfo=UTC)
    stamp = Stamp.of(IdentityHeaders(), 3, b"p")
    records: list[MarkedRecord] = [
        PlacedRecord(
            1, when, topic, "a", b"one", [("h", None), ("s", "text")], timestamp=1_700_000_000_000, partition=2
        ),
        MarkedRecord(2, when, topic, "b", None, []),  # a tombstone, nothing placed
        MarkedRecord(3, when, topic, "c", b"x" * 20_000, []),  # over message.max.bytes
        PlacedRecord(4, when, topic, "", b"four", [], partition=1),
    ]
    records[3].stamp = stamp
    publisher.publish(records)
    done = {r.id: err for r, err in _collect(reports, 4)}
    assert [done[n] for n in (1, 2, 4)] == [None, None, None]
    error = done[3]
    assert isinstance(error, DeliveryError)
    assert error.code == KafkaError.MSG_SIZE_TOO_LARGE and error.permanent
    got = {text(m.value()) if m.value() is not None else None: m for m in read_messages(services.bootstrap, [topic], 3)}
    assert set(got) == {"one", None, "four"}
    assert (got["one"].partition(), got["one"].timestamp()[1], got["one"].headers()) == (
        2,
        1_700_000_000_000,
        [("h", None), ("s", b"text")],
    )
    assert text(got[None].key()) == "b" and got[None].headers() is None
    assert got["four"].partition() == 1 and got["four"].key() == b""
    assert got["four"].headers() == [("outbox-id", b"4"), ("outbox-epoch", b"3"), ("outbox-producer", b"p")]


def test_refused_settings_fail_at_start(started: Callable[..., tuple[ProcessPublisher, Reports]]) -> None:
    with pytest.raises(KafkaException) as refused:
        started(**{"no.such.property": "1"})
    assert "no.such.property" in refused.value.args[0].str()


def test_the_child_runs_the_harvesters_package_whatever_the_working_directory(
    started: Callable[..., tuple[ProcessPublisher, Reports]],
    tmp_path: Path,
    monkeypatch: pytest.MonkeyPatch,
    topics: Callable[..., str],
) -> None:
    """A reaper started from a directory holding another version's ``harvester`` (a checkout, say):
    its child imports the reaper's own, whose frames it reads."""
    (tmp_path / "harvester").mkdir()
    (tmp_path / "harvester" / "__init__.py").write_text("raise ImportError('the wrong package')\n")
    monkeypatch.chdir(tmp_path)
    publisher, reports = started()
    publisher.publish([_record(1, topics())])
    assert [err for _, err in _collect(reports, 1)] == [None]


def test_only_forwarded_callables_run_in_the_child() -> None:
    assert runs_in_child({"bootstrap.servers": "x", "logger": logging.getLogger("x"), "error_cb": print})
    assert not runs_in_child({"bootstrap.servers": "x", "stats_cb": print})


@pytest.mark.parametrize("kind", [ProcessPublisher, NativePublisher], ids=["producer process", "native"])
def test_librdkafka_logs_and_errors_reach_the_configured_logger_and_callback(
    services: Services, kind: type[ProcessPublisher | NativePublisher]
) -> None:
    lines: list[str] = []
    errors: queue.SimpleQueue[KafkaError] = queue.SimpleQueue()

    class Keep(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            lines.append(record.getMessage())

    logger = logging.getLogger("test-rdkafka-forward")
    logger.addHandler(Keep())
    logger.setLevel(logging.DEBUG)
    # Nothing listens on port 9: the client logs the refused connection and reports an error.
    config = {"bootstrap.servers": "127.0.0.1:9", "logger": logger, "error_cb": errors.put_nowait}
    publisher = kind(producer_config(config, {}), lambda _: None, in_order=True)
    try:
        error = errors.get(timeout=30)
        assert error.code() in (KafkaError._TRANSPORT, KafkaError._ALL_BROKERS_DOWN)
        deadline = time.monotonic() + 30
        while not any("127.0.0.1:9" in line for line in lines) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert any("127.0.0.1:9" in line for line in lines)
    finally:
        publisher.close(0)


def test_a_child_that_dies_fails_what_it_left_once_each_and_a_new_one_takes_the_next(
    started: Callable[..., tuple[ProcessPublisher, Reports]], services: Services, topics: Callable[..., str]
) -> None:
    """Its keys keep their order: a later record of a key with a failed one fails too until the
    retry of its first failed record (or a new term), as an order-keeping producer's would."""
    topic = topics()
    publisher, reports = started()
    first = publisher.child_pid
    os.kill(first, signal.SIGSTOP)  # nothing it holds can be acknowledged now
    publisher.publish([_record(n, topic) for n in range(100)])
    time.sleep(0.5)
    os.kill(first, signal.SIGKILL)
    os.kill(first, signal.SIGCONT)
    left = _collect(reports, 100)
    assert sorted(r.id for r, _ in left) == list(range(100))  # each reported once
    assert all(isinstance(err, DeliveryError) and not err.permanent for _, err in left)
    publisher.publish([_record(100, topic)])  # key k: after its failed records, so it fails too
    [(late, err)] = _collect(reports, 1)
    assert late.id == 100 and isinstance(err, DeliveryError) and not err.permanent
    publisher.publish([_record(500, topic, key="other")])  # another key goes on
    for n in range(3):  # the retries, from k's first failed record
        publisher.publish([_record(n, topic)])
    after = _collect(reports, 4)
    assert sorted((r.id, err) for r, err in after) == [(0, None), (1, None), (2, None), (500, None)]
    assert publisher.child_pid != first
    landed = read_messages(services.bootstrap, [topic], 4)
    assert [text(m.value()) for m in landed if text(m.key()) == "k"] == ["v0", "v1", "v2"]
    # Another loss, then a new term: the key does not wait for its retry any more.
    os.kill(publisher.child_pid, signal.SIGSTOP)
    publisher.publish([_record(600, topic, key="j")])
    time.sleep(0.5)
    os.kill(publisher.child_pid, signal.SIGKILL)
    assert _collect(reports, 1)[0][0].id == 600
    publisher.begin_term()
    publisher.publish([_record(601, topic, key="j")])
    assert [(r.id, err) for r, err in _collect(reports, 1)] == [(601, None)]
    assert reports.empty()


def test_the_child_ignores_the_groups_signals_and_exits_when_its_harvester_dies(services: Services) -> None:
    # A harvester of its own, which the test kills as a crash would.
    script = (
        "import sys, time\n"
        "from harvester.kafka.process_publisher import ProcessPublisher\n"
        f"p = ProcessPublisher({{'bootstrap.servers': {services.bootstrap!r}, 'enable.idempotence': True}},"
        " lambda r: None, in_order=True)\n"
        "print(p.child_pid, flush=True)\n"
        "time.sleep(600)\n"
    )
    root = str(Path(__file__).resolve().parents[2])
    parent = subprocess.Popen([sys.executable, "-c", script], stdout=subprocess.PIPE, text=True, cwd=root)
    try:
        assert parent.stdout is not None
        child = int(parent.stdout.readline())
        os.kill(child, signal.SIGTERM)
        os.kill(child, signal.SIGINT)
        time.sleep(1.0)
        assert _alive(child), "the child must stop when its harvester says, not on the group's signals"
        parent.kill()
        parent.wait()
        deadline = time.monotonic() + 10
        while _alive(child) and time.monotonic() < deadline:
            time.sleep(0.1)
        assert not _alive(child), "the child of a dead harvester must exit"
    finally:
        parent.kill()


def _alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"

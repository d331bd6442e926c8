"""The HTTP endpoint: /metrics from a registry, /healthz and /readyz from probes."""

from __future__ import annotations

import json
import urllib.error
import urllib.request
from collections.abc import Iterator, Mapping

import pytest
from prometheus_client import CollectorRegistry, Counter

from harvester.daemon.http import HttpServer

pytestmark = pytest.mark.unit


class Probes:
    def __init__(self) -> None:
        self.ready = False
        self.fail = False

    def readiness(self) -> tuple[bool, Mapping[str, object]]:
        if self.fail:
            raise RuntimeError("probe broke")
        return self.ready, {"is_leader": self.ready}


@pytest.fixture
def served() -> Iterator[tuple[str, Counter, Probes]]:
    registry = CollectorRegistry()
    counter = Counter("harvester_records_published", "test series", registry=registry)
    probes = Probes()
    server = HttpServer(registry, host="127.0.0.1", port=0, readiness=probes.readiness)
    server.start()
    yield f"http://127.0.0.1:{server.port}", counter, probes
    server.close()


def get(url: str) -> tuple[int, str, str]:
    try:
        with urllib.request.urlopen(url, timeout=5) as resp:
            return resp.status, resp.headers["Content-Type"], resp.read().decode()
    except urllib.error.HTTPError as err:
        return err.code, err.headers["Content-Type"], err.read().decode()


def test_metrics_serves_the_registry(served: tuple[str, Counter, Probes]) -> None:
    base, counter, _ = served
    counter.inc(3)
    status, ctype, body = get(base + "/metrics")
    assert status == 200 and ctype.startswith("text/plain")
    assert "harvester_records_published_total 3.0" in body


def test_probes(served: tuple[str, Counter, Probes]) -> None:
    base, _, probes = served
    assert get(base + "/healthz")[0] == 200
    status, ctype, body = get(base + "/readyz")
    assert (status, ctype, json.loads(body)) == (503, "application/json", {"status": "unavailable", "is_leader": False})
    probes.ready = True
    assert json.loads(get(base + "/readyz?verbose=1")[2]) == {"status": "ok", "is_leader": True}
    probes.fail = True
    status, _, body = get(base + "/readyz")
    assert status == 503 and json.loads(body)["error"] == "RuntimeError"
    assert get(base + "/nope")[0] == 404

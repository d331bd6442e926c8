"""The supervisor of ``reaper run --workers N`` asks its workers' endpoints at once, so one hanging
worker costs a probe or a scrape one ``ASK_TIMEOUT``, not one per worker. Real HTTP servers on the
loopback stand in for the workers: the algorithm's edge case, the worker processes themselves are
tested in tests/reaper/test_workers.py."""

from __future__ import annotations

import threading
from collections.abc import Iterator
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from harvester.daemon.workers import ASK_TIMEOUT, Worker, WorkerProbes


def _server(barrier: threading.Barrier) -> ThreadingHTTPServer:
    class Handler(BaseHTTPRequestHandler):
        def do_GET(self) -> None:
            # Answers only once every worker was asked: a supervisor asking one after another
            # leaves the first waiting past its ASK_TIMEOUT, and the barrier breaks.
            try:
                barrier.wait()
                status, body = 200, b'{"is_leader": true, "leading_shards": [0]}'
            except threading.BrokenBarrierError:
                status, body = 500, b"{}"
            self.send_response(status)
            self.send_header("Content-Length", str(len(body)))
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, format: str, *args: object) -> None:
            pass

    return ThreadingHTTPServer(("127.0.0.1", 0), Handler)


@pytest.fixture
def workers(tmp_path: Path) -> Iterator[list[Worker]]:
    barrier = threading.Barrier(3, timeout=ASK_TIMEOUT * 1.5)
    servers = [_server(barrier) for _ in range(3)]
    for s in servers:
        threading.Thread(target=s.serve_forever, daemon=True).start()
    out = []
    for i, s in enumerate(servers):
        w = Worker(i, [], tmp_path)
        w.port = s.server_address[1]
        out.append(w)
    yield out
    for s in servers:
        s.shutdown()
        s.server_close()


def test_the_supervisor_asks_every_worker_at_once(workers: list[Worker]) -> None:
    ready, details = WorkerProbes(workers).readiness()
    assert ready, details
    assert details["leading_shards"] == [0]
    assert sorted(details["workers"]) == ["0", "1", "2"]  # type: ignore[call-overload]

"""A tiny HTTP server for the reaper: ``/metrics`` (Prometheus), ``/healthz`` (alive), ``/readyz`` (ready).

It runs on a daemon thread so it never holds up shutdown. Each probe is a callable returning
``(ok, details)``; the response is ``200`` or ``503`` with the details as a JSON object.
"""

from __future__ import annotations

import json
import threading
from collections.abc import Callable, Mapping
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer

from prometheus_client import CollectorRegistry
from prometheus_client.exposition import choose_encoder

Probe = Callable[[], tuple[bool, Mapping[str, object]]]
"""A health check: ``(ok, details)``; details are served as JSON."""


def always_ok() -> tuple[bool, Mapping[str, object]]:
    """A probe that always passes (the default liveness)."""
    return True, {}


class HttpServer:
    """Serves ``registry`` on ``/metrics`` and the two probes on ``/healthz`` and ``/readyz``."""

    def __init__(
        self,
        registry: CollectorRegistry,
        *,
        host: str = "0.0.0.0",  # probes and scrapers connect from outside the container
        port: int = 9090,
        liveness: Probe = always_ok,
        readiness: Probe = always_ok,
    ) -> None:
        self._registry = registry
        self._probes = {"/healthz": liveness, "/readyz": readiness}
        self._server = ThreadingHTTPServer((host, port), self._handler())
        self._server.daemon_threads = True
        self._thread = threading.Thread(target=self._server.serve_forever, name="reaper-http", daemon=True)

    @property
    def port(self) -> int:
        """The bound port (useful when 0 was configured)."""
        return int(self._server.server_address[1])

    def start(self) -> None:
        """Begin serving on a daemon thread."""
        self._thread.start()

    def close(self) -> None:
        """Stop serving and release the port."""
        self._server.shutdown()
        self._server.server_close()
        self._thread.join(5)

    def _handler(self) -> type[BaseHTTPRequestHandler]:
        registry, probes = self._registry, self._probes

        class Handler(BaseHTTPRequestHandler):
            server_version = "reaper"

            def do_GET(self) -> None:
                path = self.path.split("?", 1)[0]
                if path == "/metrics":
                    encoder, content_type = choose_encoder(self.headers.get("Accept", ""))
                    self._send(200, content_type, encoder(registry))
                    return
                probe = probes.get(path)
                if probe is None:
                    self._send(404, "text/plain; charset=utf-8", b"not found: try /metrics, /healthz or /readyz\n")
                    return
                try:
                    ok, details = probe()
                except Exception as exc:  # a failing probe means "not ok", never a crashed handler
                    ok, details = False, {"error": type(exc).__name__}
                body = json.dumps({"status": "ok" if ok else "unavailable", **details}, default=str)
                self._send(200 if ok else 503, "application/json", body.encode() + b"\n")

            def _send(self, status: int, content_type: str, body: bytes) -> None:
                self.send_response(status)
                self.send_header("Content-Type", content_type)
                self.send_header("Content-Length", str(len(body)))
                self.end_headers()
                self.wfile.write(body)

            def log_message(self, format: str, *args: object) -> None:
                """Silence per-request access logs: probes every few seconds would drown the real lines."""

        return Handler

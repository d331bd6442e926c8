"""A replication stream's connect lets the process's other threads run while the server has not
answered (libpq's blocking connect, ``PGconn.connect``, held the GIL until the server answered or
``connect_timeout`` passed: every thread of the reaper stood still meanwhile). The server here is a
socket that accepts and never answers."""

from __future__ import annotations

import socket
import threading

import pytest

from harvester.postgres.log.replication import LogicalStream, StreamError

pytestmark = pytest.mark.unit


def test_other_threads_run_while_the_stream_connects() -> None:
    with socket.create_server(("127.0.0.1", 0)) as server:
        port = server.getsockname()[1]
        failed: list[BaseException] = []

        def connect() -> None:
            try:
                LogicalStream(f"host=127.0.0.1 port={port} user=u dbname=d connect_timeout=30", "s", "p", 0)
            except StreamError as exc:
                failed.append(exc)

        connecting = threading.Thread(target=connect)
        connecting.start()
        # accept() returns (this thread runs again) while the stream waits for the server's answer,
        # and the server hangs up: the connect fails on that. With the GIL held by the connect,
        # this thread ran only once the connect had given up (timeout expired).
        client, _ = server.accept()
        client.close()
        connecting.join(60)
    assert len(failed) == 1, failed
    assert "cannot connect for replication" in str(failed[0]) and "timeout" not in str(failed[0]), failed[0]

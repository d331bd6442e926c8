"""Free loopback ports for a test's private services."""

from __future__ import annotations

import os
import socket
from pathlib import Path


def free_ports(count: int) -> int:
    """The first of ``count`` consecutive free loopback ports for a test's private services: from
    ``HARVESTER_TEST_PRIVATE_PORTS`` (``low-high``) when set, so that engineers sharing a machine keep
    to their own ranges, else below the kernel's ephemeral range. A port in that range may be taken
    by any outgoing connection while its service restarts, and a test restarting brokers would then
    fail to bind it again."""
    wanted = os.environ.get("HARVESTER_TEST_PRIVATE_PORTS")
    if wanted:
        low, high = (int(p) for p in wanted.split("-"))
    else:
        low, high = _FALLBACK_PORTS[0], min(_FALLBACK_PORTS[1], _ephemeral_low() - 1)
    # Each of pytest-xdist's workers takes its own slice: a worker does not see another's hand-outs,
    # and a port one found free (for "nothing listens there") the other gave a private service.
    workers = int(os.environ.get("PYTEST_XDIST_WORKER_COUNT", "1"))
    worker = os.environ.get("PYTEST_XDIST_WORKER", "")
    if workers > 1 and worker.startswith("gw"):
        size = (high - low + 1) // workers
        low += int(worker[2:]) * size
        high = low + size - 1
    for first in range(low, high - count + 2):
        block = range(first, first + count)
        # Never twice in one run: a service given a block may bind only some of it, or only later.
        if _HANDED_OUT.isdisjoint(block) and all(_free(p) for p in block):
            _HANDED_OUT.update(block)
            return first
    raise RuntimeError(f"no {count} consecutive free loopback ports in {low}-{high}")


_FALLBACK_PORTS = (24000, 32767)  # below Linux's default ephemeral range (32768-60999)
_HANDED_OUT: set[int] = set()
# The suite's fixed ports and the shared services' (services.sh start and start-secure).
_TAKEN = frozenset((15432, 29092, 29093, 19092, 19093, 5432, 9092, 9093, 5442, 9192, 9193))


def _ephemeral_low() -> int:
    try:
        return int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_PORTS[1] + 1


def _free(port: int) -> bool:
    if port in _TAKEN:
        return False
    with socket.socket() as s:
        try:
            s.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True

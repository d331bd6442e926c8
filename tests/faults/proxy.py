"""A TCP proxy under a test's control, to cut one process's path to a service while the others
keep theirs (no root, no firewall rules).

Modes (:meth:`Proxy.set_mode`):

- ``pass``: forward both ways;
- ``cut``: close every connection (FIN) and refuse new ones (the listening socket is closed);
- ``stall``: accept, but forward nothing either way; bytes wait in the proxy and the kernel
  buffers and flow again when the mode returns to ``pass`` or ``slow`` (a partition that heals);
- ``slow``: forward each chunk after ``delay`` seconds;
- ``reset``: abort every connection with an RST, and every new one as soon as it is accepted.
"""

from __future__ import annotations

import socket
import struct
import threading
import time
from contextlib import suppress
from typing import Literal

Mode = Literal["pass", "cut", "stall", "slow", "reset"]
MODES: tuple[Mode, ...] = ("pass", "cut", "stall", "slow", "reset")


class Proxy:
    """Forwards ``127.0.0.1:<port>`` to ``target``; ``port`` 0 picks a free one (see :attr:`port`)."""

    def __init__(self, target: tuple[str, int], port: int = 0, *, delay: float = 0.2) -> None:
        self.target = target
        self.delay = delay
        self._mode: Mode = "pass"
        self._cond = threading.Condition()
        self._pairs: set[tuple[socket.socket, socket.socket]] = set()
        self._closed = False
        self._listener: socket.socket | None = None
        self.port = port
        self._listen()
        self.port = self._bound_port
        self.connections = 0  # accepted so far

    # ------------------------------------------------------------------ control

    @property
    def mode(self) -> Mode:
        return self._mode

    def set_mode(self, mode: Mode) -> None:
        """Switch mode; ``cut`` and ``reset`` act on the open connections at once."""
        if mode not in MODES:
            raise ValueError(f"unknown proxy mode {mode!r}")
        with self._cond:
            previous, self._mode = self._mode, mode
            pairs = list(self._pairs)
            self._cond.notify_all()
        if mode == "cut":
            self._unlisten()  # first: a client reconnecting once its connection drops is refused
        elif previous == "cut":
            self._listen()
        if mode in ("cut", "reset"):
            for pair in pairs:
                self._drop(pair, reset=mode == "reset")

    def close(self) -> None:
        """Stop listening and drop every connection."""
        with self._cond:
            self._closed = True
            pairs = list(self._pairs)
            self._cond.notify_all()
        self._unlisten()
        for pair in pairs:
            self._drop(pair, reset=False)

    def __enter__(self) -> Proxy:
        return self

    def __exit__(self, *_: object) -> None:
        self.close()

    @property
    def address(self) -> str:
        return f"127.0.0.1:{self.port}"

    # ------------------------------------------------------------------ listening

    def _listen(self) -> None:
        deadline = time.monotonic() + 30.0
        while True:
            sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
            try:
                sock.bind(("127.0.0.1", self.port))
                break
            except OSError:
                # A fixed port may be held for a moment by a socket of its previous life.
                sock.close()
                if self.port == 0 or time.monotonic() > deadline:
                    raise
                time.sleep(0.5)
        sock.listen(128)
        self._bound_port = int(sock.getsockname()[1])
        self._listener = sock
        threading.Thread(target=self._accept, args=(sock,), name=f"proxy-{self._bound_port}", daemon=True).start()

    def _unlisten(self) -> None:
        sock, self._listener = self._listener, None
        if sock is not None:
            with suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)  # wakes the accept() of its thread
            sock.close()

    def _accept(self, listener: socket.socket) -> None:
        while True:
            try:
                client, _ = listener.accept()
            except OSError:
                return  # closed by _unlisten
            self.connections += 1
            if self._mode == "reset":
                _abort(client)
                continue
            try:
                upstream = socket.create_connection(self.target, timeout=5)
            except OSError:
                _abort(client)  # the service itself is down: the client sees its connection refused
                continue
            upstream.settimeout(None)
            pair = (client, upstream)
            with self._cond:
                # A connection accepted just before a switch to ``cut`` or ``reset`` (a client
                # reconnecting at once to the connections that switch dropped) is not among the pairs
                # it dropped: it must not forward either. The mode is read under the lock set_mode
                # switches it under, so every pair is dropped by one or the other.
                closed, mode = self._closed, self.mode  # (the property: mypy narrowed _mode above)
                if not closed and mode not in ("cut", "reset"):
                    self._pairs.add(pair)
            if closed or mode in ("cut", "reset"):
                for sock in pair:
                    if mode == "reset":
                        _abort(sock)
                    else:
                        _close(sock)
                if closed:
                    return
                continue
            for src, dst in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pump, args=(pair, src, dst), daemon=True).start()

    # ------------------------------------------------------------------ forwarding

    def _pump(self, pair: tuple[socket.socket, socket.socket], src: socket.socket, dst: socket.socket) -> None:
        try:
            while True:
                data = src.recv(65536)
                if not data:
                    break
                if not self._hold(pair):
                    return
                if self._mode == "slow":
                    time.sleep(self.delay)
                dst.sendall(data)
        except OSError:
            pass
        self._drop(pair, reset=False)

    def _hold(self, pair: tuple[socket.socket, socket.socket]) -> bool:
        """Wait while stalled; False when the connection was dropped meanwhile."""
        with self._cond:
            while self._mode == "stall" and pair in self._pairs and not self._closed:
                self._cond.wait()
            return pair in self._pairs

    def _drop(self, pair: tuple[socket.socket, socket.socket], *, reset: bool) -> None:
        with self._cond:
            if pair not in self._pairs and not self._closed:
                return
            self._pairs.discard(pair)
            self._cond.notify_all()
        for sock in pair:
            if reset:
                _abort(sock)
            else:
                _close(sock)


def _close(sock: socket.socket) -> None:
    """Close with a FIN."""
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RDWR)
    sock.close()


def _abort(sock: socket.socket) -> None:
    """Close with an RST instead of a FIN (SO_LINGER with a zero timeout)."""
    with suppress(OSError):
        sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
    with suppress(OSError):
        sock.shutdown(socket.SHUT_RD)  # wakes a pump blocked in recv() without sending a FIN
    sock.close()

"""Test helpers for object stores: moto's S3 server on 127.0.0.1 and a loopback TCP proxy that can stall or
drop connections (a store that hangs mid-upload, a network that goes away)."""

from __future__ import annotations

import contextlib
import re
import select
import socket
import subprocess
import sys
import threading
import time
from collections.abc import Iterator

MOTO_START_TIMEOUT_S = 300  # up in ~1 s on a quiet machine; 8 s measured on a loaded 2-core one


@contextlib.contextmanager
def moto_server() -> Iterator[str]:
    """Start ``python -m moto.server`` on a loopback port it binds itself (``-p 0``: no free-port-then-bind race
    with other processes) and yield its endpoint URL, read from the server's own startup line."""
    proc = subprocess.Popen(
        [sys.executable, "-m", "moto.server", "-H", "127.0.0.1", "-p", "0"],
        stdout=subprocess.DEVNULL,
        stderr=subprocess.PIPE,
        text=True,
    )
    found = threading.Event()
    url: list[str] = []

    def drain() -> None:  # the server logs every request on stderr: read it all, or it blocks on a full pipe
        assert proc.stderr is not None
        for line in proc.stderr:
            m = None if found.is_set() else re.search(r"Running on (http://127\.0\.0\.1:\d+)", line)
            if m:
                url.append(m.group(1))
                found.set()
        found.set()  # exited before (or after) serving

    threading.Thread(target=drain, daemon=True).start()
    try:
        if not found.wait(MOTO_START_TIMEOUT_S) or not url:
            raise RuntimeError(
                f"moto server not serving after {MOTO_START_TIMEOUT_S} s (exit code {proc.poll()}); is "
                "'moto[server]' installed?"
            )
        yield url[0]
    finally:
        proc.terminate()
        try:
            proc.wait(10)
        except subprocess.TimeoutExpired:
            proc.kill()
            proc.wait()


class Proxy:
    """A loopback TCP proxy in front of ``target_port``.

    ``mode``: ``"pass"`` forwards bytes; ``"stall"`` accepts and holds connections without forwarding a byte
    (a hung store); ``"drop"`` closes every connection at once (a store that went away). Existing connections
    are cut when the mode changes away from ``"pass"``. ``connections`` counts accepted connections.
    """

    def __init__(self, target_port: int) -> None:
        self.target_port = target_port
        self.mode = "pass"
        self.connections = 0
        self._sock = socket.socket()
        self._sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._sock.bind(("127.0.0.1", 0))
        self._sock.listen(64)
        self.port = int(self._sock.getsockname()[1])
        self._open: list[socket.socket] = []
        self._lock = threading.Lock()
        self._closed = False
        threading.Thread(target=self._accept, daemon=True).start()

    @property
    def url(self) -> str:
        return f"http://127.0.0.1:{self.port}"

    def set_mode(self, mode: str) -> None:
        assert mode in ("pass", "stall", "drop")
        self.mode = mode
        if mode != "pass":
            with self._lock:
                socks, self._open = self._open, []
            for s in socks:
                with contextlib.suppress(OSError):
                    s.close()

    def _accept(self) -> None:
        while not self._closed:
            try:
                client, _ = self._sock.accept()
            except OSError:
                return
            self.connections += 1
            if self.mode == "drop":
                client.close()
                continue
            if self.mode == "stall":
                with self._lock:
                    self._open.append(client)  # held, never answered
                continue
            try:
                upstream = socket.create_connection(("127.0.0.1", self.target_port))
            except OSError:
                client.close()
                continue
            with self._lock:
                self._open += [client, upstream]
            threading.Thread(target=self._pump, args=(client, upstream), daemon=True).start()

    def _pump(self, a: socket.socket, b: socket.socket) -> None:
        try:
            while True:
                if self.mode == "stall":
                    time.sleep(0.05)  # hold the bytes: no progress either way
                    continue
                r, _, _ = select.select([a, b], [], [], 0.2)
                for s in r:
                    data = s.recv(1 << 16)
                    if not data:
                        return
                    (b if s is a else a).sendall(data)
        except (OSError, ValueError):  # ValueError: the other side closed the socket (select on fd -1)
            return
        finally:
            for s in (a, b):
                with contextlib.suppress(OSError):
                    s.close()

    def close(self) -> None:
        self._closed = True
        self.set_mode("drop")
        with contextlib.suppress(OSError):
            self._sock.close()

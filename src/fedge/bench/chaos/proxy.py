"""A TCP proxy between one agent and the broker that can drop, stall or truncate.

The agent's agent.toml names the proxy's port as its broker; the proxy opens a fresh
upstream connection for each connection it accepts, so it outlives broker restarts.
Modes (switched at any time from another thread):

- ``pass``: bytes flow both ways.
- ``drop``: every open connection is cut at once, new ones are accepted and closed (what
  a pulled cable followed by a flapping link looks like to both ends).
- ``stall``: nothing is read from either side; connections stay open and the kernel
  buffers fill (a congested or half-dead link: the MQTT keep-alive is what notices).
  Back in ``pass``, the held bytes flow again.
- ``truncate``: the next chunk on each connection is forwarded only in part, then the
  connection is cut -- the far side sees half an MQTT packet.

Threads, not asyncio: two pumps per connection and one agent per proxy keep the count
small, and blocking sockets keep the cut semantics obvious.
"""

import contextlib
import select
import socket
import threading
from collections import Counter
from enum import StrEnum

CHUNK = 65536
POLL_S = 0.1


class ProxyMode(StrEnum):
    PASS = "pass"
    DROP = "drop"
    STALL = "stall"
    TRUNCATE = "truncate"


class _Link:
    """One proxied connection: the client side and its upstream."""

    def __init__(self, client: socket.socket, upstream: socket.socket) -> None:
        self.client = client
        self.upstream = upstream
        self.closed = threading.Event()

    def close(self) -> None:
        if self.closed.is_set():
            return
        self.closed.set()
        for sock in (self.client, self.upstream):
            with contextlib.suppress(OSError):
                sock.shutdown(socket.SHUT_RDWR)
            with contextlib.suppress(OSError):
                sock.close()


class FaultyProxy:
    def __init__(self, upstream_host: str, upstream_port: int, name: str = "proxy") -> None:
        self.upstream = (upstream_host, upstream_port)
        self.name = name
        self._listener = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
        self._listener.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        self._listener.bind(("127.0.0.1", 0))
        self._listener.listen(64)
        self.port = int(self._listener.getsockname()[1])
        self._mode = ProxyMode.PASS
        self._lock = threading.Lock()
        self._links: set[_Link] = set()
        self._stop = threading.Event()
        self.counters: Counter[str] = Counter()
        self._acceptor = threading.Thread(target=self._accept, name=f"{name}-accept", daemon=True)

    def start(self) -> "FaultyProxy":
        self._acceptor.start()
        return self

    @property
    def mode(self) -> ProxyMode:
        return self._mode

    def set_mode(self, mode: ProxyMode) -> None:
        with self._lock:
            self._mode = mode
            links = list(self._links) if mode is ProxyMode.DROP else []
        for link in links:
            self.counters["dropped"] += 1
            link.close()

    def close(self) -> None:
        self._stop.set()
        with contextlib.suppress(OSError):
            self._listener.close()
        with self._lock:
            links = list(self._links)
        for link in links:
            link.close()
        self._acceptor.join(timeout=2)

    def _stalled(self) -> bool:
        return self._mode is ProxyMode.STALL

    # -- threads

    def _accept(self) -> None:
        while not self._stop.is_set():
            try:
                ready, _, _ = select.select([self._listener], [], [], POLL_S)
                if not ready:
                    continue
                client, _ = self._listener.accept()
            except OSError:
                return  # closed
            self.counters["accepted"] += 1
            if self._mode is ProxyMode.DROP:
                self.counters["refused"] += 1
                client.close()
                continue
            try:
                upstream = socket.create_connection(self.upstream, timeout=2.0)
                upstream.settimeout(None)
            except OSError:
                # The broker is down: the agent sees a refused connection, as it would.
                self.counters["upstream_refused"] += 1
                client.close()
                continue
            link = _Link(client, upstream)
            with self._lock:
                self._links.add(link)
            for src, dst, way in ((client, upstream, "up"), (upstream, client, "down")):
                threading.Thread(
                    target=self._pump, args=(link, src, dst), name=f"{self.name}-{way}", daemon=True
                ).start()

    def _pump(self, link: _Link, src: socket.socket, dst: socket.socket) -> None:
        try:
            while not link.closed.is_set() and not self._stop.is_set():
                if self._stalled():
                    link.closed.wait(POLL_S)  # hold the bytes in the kernel's buffers
                    continue
                ready, _, _ = select.select([src], [], [], POLL_S)
                if not ready:
                    continue
                data = src.recv(CHUNK)
                if not data:
                    break
                mode = self._mode
                if mode is ProxyMode.TRUNCATE:
                    dst.sendall(data[: len(data) // 2])
                    self.counters["truncated"] += 1
                    break
                if mode is ProxyMode.DROP:
                    break
                if mode is ProxyMode.STALL:
                    # Read just before the stall began: hold it until the link flows again.
                    while self._stalled() and not link.closed.wait(POLL_S):
                        pass
                dst.sendall(data)
        except OSError:
            pass
        finally:
            link.close()
            with self._lock:
                self._links.discard(link)

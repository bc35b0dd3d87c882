"""Pick a TCP port on 127.0.0.1 for a server fedge starts itself.

The users: tests, the demo and benchmarks (brokers, gRPC, the SuperLink), and an agent
starting its SuperNode, whose ClientApp port only the station itself connects to.

The usual trick -- bind port 0, read the port, close, hand it on -- draws from the
kernel's *ephemeral* range, the same range every outgoing connection takes its local port
from. Between the hand-over and the server's own bind, any client on the machine (an MQTT
session, an HTTP probe, a SuperNode) may be given that port as its local end, and the
server then fails with "address in use". CI hit exactly that (a gRPC server, port 40061).

So ports are drawn at random from *below* the ephemeral range, where the kernel never
assigns local ports on its own; each is checked by binding it, and a port already handed
out by this process is not handed out again. What is left is a race with another program
choosing the same port in the same moment, which 10^4 candidates make rare.
"""

import random
import socket
import threading
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000
_FALLBACK_EPHEMERAL_START = 32768  # Linux's default when the range cannot be read
_given: set[int] = set()
_lock = threading.Lock()


def ephemeral_start() -> int:
    """The lowest port the kernel hands out to outgoing connections."""
    try:
        return int(_RANGE_FILE.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return _FALLBACK_EPHEMERAL_START


def _bindable(port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        try:
            sock.bind(("127.0.0.1", port))
        except OSError:
            return False
    return True


def free_port() -> int:
    """A port on 127.0.0.1 that is free now and that no outgoing connection will take."""
    top = ephemeral_start()
    with _lock:
        if top - _LOWEST >= 1000:
            for _ in range(200):
                port = random.randrange(_LOWEST, top)
                if port not in _given and _bindable(port):
                    _given.add(port)
                    return port
        # A machine whose ephemeral range starts low: fall back to the kernel's choice.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        _given.add(port)
        return port

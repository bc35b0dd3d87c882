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
out by this process is not handed out again.

That leaves a race with another process choosing the same port before either server
binds it: the test suite's parallel workers, the processes a test starts, a benchmark
beside them. So a port is also *claimed* machine-wide: a file named after it, created
exclusively in a per-user directory under the system temp dir. A claim lapses after
``CLAIM_TTL_S``: by then the server it was drawn for has bound the port (and the bind
check refuses it) or never will. The directory holds at most one small file per port of
the range; a claim outlives its process, since the server it was drawn for may be
another process started later.
"""

import errno
import fcntl
import os
import random
import socket
import tempfile
import threading
import time
from pathlib import Path

_RANGE_FILE = Path("/proc/sys/net/ipv4/ip_local_port_range")
_LOWEST = 20000
_FALLBACK_EPHEMERAL_START = 32768  # Linux's default when the range cannot be read
CLAIM_TTL_S = 300.0
_given: set[int] = set()
_lock = threading.Lock()


def _claims_dir() -> Path:
    # Per user: another user's directory of the same name is neither trusted nor needed.
    return Path(tempfile.gettempdir()) / f"fedge-ports-{os.getuid()}"


def _claim(port: int) -> bool:
    """Claim ``port`` for this process machine-wide; False when another process holds a
    live claim. A machine where claims cannot be written (no temp dir) claims nothing and
    keeps the bind check alone.

    Claims are made under an exclusive ``flock`` of the directory's lock file, so two
    processes that both find a lapsed claim cannot both take it over."""
    directory = _claims_dir()
    path = directory / str(port)
    try:
        directory.mkdir(mode=0o700, exist_ok=True)
        with open(directory / ".lock", "a") as lock:
            fcntl.flock(lock, fcntl.LOCK_EX)
            try:
                if time.time() - path.stat().st_mtime < CLAIM_TTL_S:
                    return False
                path.unlink()  # a lapsed claim: its server bound the port or never will
            except FileNotFoundError:
                pass
            os.close(os.open(path, os.O_CREAT | os.O_EXCL | os.O_WRONLY, 0o600))
            return True
    except OSError as exc:
        if exc.errno in (errno.EACCES, errno.EROFS, errno.ENOSPC, errno.EPERM):
            return True
        raise


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
                if port not in _given and _bindable(port) and _claim(port):
                    _given.add(port)
                    return port
        # A machine whose ephemeral range starts low: fall back to the kernel's choice.
        with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
            sock.bind(("127.0.0.1", 0))
            port = int(sock.getsockname()[1])
        _given.add(port)
        return port

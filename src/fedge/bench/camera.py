"""A line camera's software for ``fedge bench inference --path api``: its own process.

A camera (or the station's line software) is never inside the agent's process, so the
bench does not time the API from a thread of it: there the client would share the
interpreter lock with the agent's threads and charge the agent for the bench's own
Python. This process POSTs one image per request on a new connection (HTTP/1.0, as the
local API speaks) and times it, for the agent and the bare baseline endpoint alike.

Protocol on stdin/stdout, one line each way: ``PORT INDEX`` (the image ``INDEX`` of the
directory's sorted ``*.png`` files) -> the request's milliseconds, or ``error: ...``.
"""

import http.client
import sys
import time
from pathlib import Path


def post(port: int, data: bytes) -> float:
    """One ``POST /v1/score`` on a new connection; ms until the reply was read."""
    started = time.perf_counter()
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=60)
    try:
        conn.request("POST", "/v1/score", body=data, headers={"Content-Type": "image/png"})
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    elapsed = (time.perf_counter() - started) * 1000.0
    if response.status != 200:
        raise RuntimeError(f"POST /v1/score answered {response.status}: {body[:200]!r}")
    return elapsed


def main(directory: Path) -> None:
    images = [path.read_bytes() for path in sorted(directory.glob("*.png"))]
    for line in sys.stdin:
        try:
            port, index = (int(field) for field in line.split())
            reply = f"{post(port, images[index]):.6f}"
        except Exception as exc:  # told to the bench, which stops with it
            reply = f"error: {exc}".replace("\n", " ")
        sys.stdout.write(reply + "\n")
        sys.stdout.flush()


if __name__ == "__main__":
    main(Path(sys.argv[1]))

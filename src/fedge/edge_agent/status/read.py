"""Reading a station's status: its running agent's local API, else its file read-only.

``fedge agent status`` runs on the station beside the agent. A running agent knows what
it holds in memory (the model that serves, the thresholds it decides with, whether the
broker is connected); it answers on its local API (``http_port`` in agent.toml). When
that is off or does not answer, the agent file (``agent.db``) is read read-only -- never
written, whether an agent runs on it or not -- and the status says which it was and why.
"""

import http.client
import json
from typing import Any

from fedge.edge_agent.settings import AgentSettings
from fedge.edge_agent.status.view import (
    StationStatus,
    counts_from_reply,
    counts_of,
    from_api,
    from_facts,
)
from fedge.edge_agent.store import read_facts

STATUS_PATH = "/v1/status"


def read_status(settings: AgentSettings, *, timeout_s: float = 3.0) -> StationStatus:
    """The station's status from its running agent, or from ``agent.db`` read-only."""
    db = settings.data_dir / "agent.db"
    if settings.http_port:
        where = f"http://127.0.0.1:{settings.http_port}{STATUS_PATH}"
        try:
            reply = _get_json(settings.http_port, timeout_s)
        except (OSError, http.client.HTTPException, ValueError) as exc:
            why = f"no running agent answered at {where}: {_reason(exc)}"
        else:
            if reply.get("edge") == settings.edge:
                plain = reply.get("counts")
                # An agent older than the counts in its reply: its file has them.
                counts = (
                    counts_from_reply(plain)
                    if isinstance(plain, dict)
                    else counts_of(read_facts(db))
                )
                return from_api(reply, counts, f"the running agent ({where})")
            why = f"{where} answered for edge {reply.get('edge')!r}, not {settings.edge!r}"
    else:
        why = "the local API is off (http_port = 0 in agent.toml)"
    return from_facts(settings.edge, read_facts(db), f"{db}, read-only ({why})")


def _get_json(port: int, timeout_s: float) -> dict[str, Any]:
    # http.client, not urllib: no proxy from the environment stands between the station
    # and its own loopback.
    conn = http.client.HTTPConnection("127.0.0.1", port, timeout=timeout_s)
    try:
        conn.request("GET", STATUS_PATH)
        response = conn.getresponse()
        body = response.read()
    finally:
        conn.close()
    if response.status != 200:
        raise ValueError(f"HTTP {response.status}")
    data = json.loads(body)
    if not isinstance(data, dict):
        raise ValueError("not a JSON object")
    return data


def _reason(exc: BaseException) -> str:
    if isinstance(exc, ConnectionRefusedError):
        return "connection refused (the agent is not running, or runs with another http_port)"
    if isinstance(exc, TimeoutError):
        return "no reply in time"
    return str(exc) or type(exc).__name__

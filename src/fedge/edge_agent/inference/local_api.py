"""A small local HTTP API on 127.0.0.1 for the station's own software.

    POST /v1/score   body: image bytes (PNG/JPEG/BMP)   -> the prediction record (JSON)
    POST /v1/labels  {"prediction_id", "label", "who"}   -> {"label_id"}
    GET  /v1/status                                      -> agent status, its counts,
                                                            and whether torch / flwr
                                                            are loaded
    GET  /metrics, /healthz, /readyz                     -> Prometheus metrics, alive,
                                                            ready (issue 27)

Bound to loopback only: whoever can reach it is already on the station.
"""

import json
import logging
import sqlite3
import sys
import threading
import time
import uuid
from dataclasses import asdict
from http import HTTPStatus
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.errors import AgentError, NotServingError, StorageError
from fedge.edge_agent.inference.images import MAX_IMAGE_BYTES
from fedge.edge_agent.inference.scorer import ImageFile
from fedge.edge_agent.status.view import counts_of
from fedge.protocols import codec, validate
from fedge.protocols.errors import ProtocolError
from fedge.transport.metrics import probe_reply

log = logging.getLogger(__name__)


def add_label(agent: EdgeAgent, prediction_id: str, label: str, who: str) -> str:
    """Validate and store an operator label on the device; returns its id."""
    try:
        validate.identifier(prediction_id, "prediction_id")
        validate.identifier(label, "label")
        validate.bounded_text(who, "who", 128)
    except ProtocolError as exc:
        raise AgentError(str(exc)) from None
    if not agent.store.has_prediction(prediction_id):
        raise AgentError(f"no prediction {prediction_id!r} on this edge")
    label_id = f"l-{uuid.uuid4().hex}"
    at = time.time()
    try:
        agent.store.add_label(label_id, prediction_id, label, who, at)
        # The station's training set joins it to the kept image (by prediction id).
        agent.station.label(prediction_id, label, at)
    except sqlite3.Error as exc:
        agent.counters["store.write_failed"] += 1
        raise StorageError(f"label not recorded ({exc}); is the station's disk full?") from None
    return label_id


# The training stack: an inference-only agent must never load it (it is not installed
# with `fedge[agent]`, and torch alone would cost hundreds of MB of RSS).
TRAINING_STACK = ("torch", "flwr")


def training_stack_imported() -> dict[str, bool]:
    """Whether each module of the training stack is loaded in this process."""
    return {name: sys.modules.get(name) is not None for name in TRAINING_STACK}


class _Handler(BaseHTTPRequestHandler):
    agent: EdgeAgent
    # A reply's status line, headers and body leave in one write, flushed when the
    # request is done (http.server's default, 0, sends headers and body apart: two
    # syscalls per reply on the line camera's path, and a small second segment that
    # Nagle's algorithm may hold for the client's delayed ACK).
    wbufsize = 64 * 1024

    def log_message(self, format: str, *args: Any) -> None:
        log.debug("local api: " + format, *args)

    def _reply(self, status: HTTPStatus, body: object) -> None:
        data = json.dumps(body).encode()
        self.send_response(status)
        self.send_header("Content-Type", "application/json")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def _body(self) -> bytes:
        length = int(self.headers.get("Content-Length") or 0)
        if length > MAX_IMAGE_BYTES:
            raise AgentError(f"request body of {length} bytes is over {MAX_IMAGE_BYTES}")
        return self.rfile.read(length)

    def do_GET(self) -> None:
        probe = probe_reply(self.path, self.agent.metrics.registry, self.agent.readiness)
        if probe is not None:
            self.send_response(probe.status)
            self.send_header("Content-Type", probe.content_type)
            self.send_header("Content-Length", str(len(probe.body)))
            self.end_headers()
            self.wfile.write(probe.body)
        elif self.path == "/v1/status":
            # The counts `fedge agent status` shows (issue 27): from the file, as they
            # would be read with the agent stopped.
            counts = asdict(counts_of(self.agent.store.facts()))
            status = {**self.agent.status(), "counts": counts}
            self._reply(HTTPStatus.OK, {**status, "imported": training_stack_imported()})
        else:
            self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})

    def do_POST(self) -> None:
        try:
            if self.path == "/v1/score":
                file = ImageFile(
                    self._body(),
                    _suffix(self.headers.get("Content-Type", "")),
                    self.headers.get("X-Source", "api"),
                )
                scored = self.agent.score_image(
                    file.data, suffix=file.suffix, source=file.source, keep=False
                )
                # The reply leaves before the training copy is handed over: the record
                # is durable already (the contract), the copy never was part of it, and
                # handing it to the keeper thread wakes that thread, which then contends
                # for the GIL with this one while it writes the reply (a py-spy profile
                # put 18 % of this path's samples there; issue 25). A client gone before
                # its reply still leaves the copy kept.
                try:
                    self._reply(HTTPStatus.OK, codec.to_plain(scored.record))
                    self.wfile.flush()
                finally:
                    self.agent.scorer.keep(scored.record, file)
            elif self.path == "/v1/labels":
                body = json.loads(self._body())
                if not isinstance(body, dict):
                    raise AgentError("expected a JSON object")
                label_id = add_label(
                    self.agent,
                    str(body.get("prediction_id", "")),
                    str(body.get("label", "")),
                    str(body.get("who", "operator")),
                )
                self._reply(HTTPStatus.OK, {"label_id": label_id})
            else:
                self._reply(HTTPStatus.NOT_FOUND, {"error": f"no route {self.path}"})
        except (StorageError, NotServingError) as exc:
            # The station cannot score or record now (a full disk; no model yet, e.g. for
            # the moment between a restart that found its model corrupted and the
            # redeployment): retry later, not a bad request.
            self.agent.counters["api.unavailable"] += 1
            self._reply(HTTPStatus.SERVICE_UNAVAILABLE, {"error": str(exc)})
        except (AgentError, json.JSONDecodeError, ValueError) as exc:
            self.agent.counters["api.bad_request"] += 1
            self._reply(HTTPStatus.BAD_REQUEST, {"error": str(exc)})


_SUFFIXES = {"image/jpeg": ".jpg", "image/bmp": ".bmp", "image/x-portable-graymap": ".pgm"}


def _suffix(content_type: str) -> str:
    """The file suffix a kept image gets (PNG unless the request says otherwise)."""
    return _SUFFIXES.get(content_type.split(";")[0].strip().lower(), ".png")


def bind_local_api(agent: EdgeAgent, port: int) -> ThreadingHTTPServer:
    """The local API bound to 127.0.0.1:``port``, not serving yet (see :func:`start_local_api`)."""
    handler = type("Handler", (_Handler,), {"agent": agent})
    try:
        return ThreadingHTTPServer(("127.0.0.1", port), handler)
    except OSError as exc:
        raise AgentError(
            f"cannot serve the local API on 127.0.0.1 port {port}: {exc.strerror}; another "
            "process is using it: set http_port in agent.toml to a free port (0 turns it off)"
        ) from None


def start_local_api(server: ThreadingHTTPServer) -> None:
    threading.Thread(target=server.serve_forever, name="local-api", daemon=True).start()


def serve_local_api(agent: EdgeAgent, port: int) -> ThreadingHTTPServer:
    server = bind_local_api(agent, port)
    start_local_api(server)
    return server

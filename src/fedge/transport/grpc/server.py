"""Cloud-side gRPC adapter: model downloads, report uploads and desired-document sync.

Thin on purpose: artifacts come from an :class:`ArtifactSource`, payloads go to a
:class:`ReportSink`, desired documents come from a :class:`DesiredSource`, status
documents go to a :class:`StatusSink`. Who calls is decided in
:mod:`~fedge.transport.grpc.identity`: under mutual TLS the station's certificate, in
development an :class:`EdgeAuthenticator` checking a token. Storage, parsing and MQTT
live elsewhere; this module only speaks gRPC.
"""

from __future__ import annotations

import logging
import threading
from collections.abc import Iterator, Sequence
from concurrent import futures
from dataclasses import dataclass
from pathlib import Path
from typing import NoReturn, Protocol

import grpc

from fedge.protocols.grpc import fedge_pb2, fedge_pb2_grpc
from fedge.protocols.pki import TlsFiles
from fedge.transport.grpc import identity
from fedge.transport.grpc.contract import (
    DESIRED_KINDS,
    STATUS_KINDS,
    DesiredDocument,
    SinkResult,
    newer_than,
)
from fedge.transport.grpc.identity import EDGE_KEY as EDGE_KEY
from fedge.transport.grpc.identity import TOKEN_KEY as TOKEN_KEY
from fedge.transport.grpc.identity import EdgeAuthenticator as EdgeAuthenticator
from fedge.transport.grpc.tls import server_credentials

log = logging.getLogger(__name__)

COUNTER_NAMES = (
    "unauthenticated",
    "permission_denied",
    "invalid_argument",
    "not_found",
    "out_of_range",
    "oversized",
    "rejected",
    "sink_errors",
    "source_errors",
)

# A real Fetch request is an edge name and three versions, well under 300 bytes.
MAX_DESIRED_REQUEST = 4096


class ArtifactSource(Protocol):
    """Where model artifacts come from; every method raises ``LookupError`` if unknown."""

    def manifest_envelope(self, name: str, version: int) -> bytes: ...

    def artifact_path(self, name: str, version: int) -> Path: ...

    def artifact_sha256(self, name: str, version: int) -> str: ...


class DesiredSource(Protocol):
    """The newest desired document of each kind for ``edge`` (none for a kind never set)."""

    def latest_desired(self, edge: str) -> Sequence[DesiredDocument]: ...


class StatusSink(Protocol):
    """Takes one status payload (liveness, config report or deploy status: the MQTT JSON
    bytes of ``kind``'s up/ topic) from an authenticated edge."""

    def ingest_status(self, edge: str, kind: str, payload: bytes) -> SinkResult: ...


class ReportSink(Protocol):
    """Takes one record-batch payload (the MQTT JSON bytes) from an authenticated edge."""

    def ingest_payload(self, edge: str, payload: bytes) -> SinkResult: ...


class Counters:
    """Thread-safe rejection counters; gRPC handlers run on a thread pool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._counts = dict.fromkeys(COUNTER_NAMES, 0)

    def incr(self, name: str) -> None:
        with self._lock:
            self._counts[name] = self._counts.get(name, 0) + 1

    def snapshot(self) -> dict[str, int]:
        with self._lock:
            return dict(self._counts)


@dataclass(frozen=True)
class _Artifact:
    manifest_envelope: bytes
    path: Path
    sha256: str
    size: int


class GrpcServices:
    """The ModelDownload, ReportUpload and DesiredSync servicers, sharing config and counters.

    Without ``desired`` and ``status_sink`` DesiredSync answers UNIMPLEMENTED. With
    ``tls`` the port is mutual TLS and callers are their certificates (``authenticate``
    is then unused); without, plain TCP with tokens (``--insecure``, development only).
    """

    def __init__(
        self,
        source: ArtifactSource,
        sink: ReportSink,
        authenticate: EdgeAuthenticator,
        *,
        desired: DesiredSource | None = None,
        status_sink: StatusSink | None = None,
        chunk_size_default: int = 256 * 1024,
        max_chunk: int = 4 * 1024 * 1024,
        max_payload: int = 1 * 1024 * 1024,
        tls: TlsFiles | None = None,
    ) -> None:
        if not 0 < chunk_size_default <= max_chunk:
            raise ValueError("need 0 < chunk_size_default <= max_chunk")
        self.source = source
        self.sink = sink
        self.authenticate = authenticate
        self.desired = desired
        self.status_sink = status_sink
        self.chunk_size_default = chunk_size_default
        self.max_chunk = max_chunk
        self.max_payload = max_payload
        self.tls = tls
        crl = None if tls is None or tls.crl is None else identity.RevocationList(tls.crl)
        self._identity: identity.CallerIdentity = identity.TokenIdentity(authenticate)
        if tls is not None:
            self._identity = identity.CertificateIdentity(crl)
        self._counters = Counters()

    @property
    def counters(self) -> dict[str, int]:
        """A snapshot of the rejection counters."""
        return self._counters.snapshot()

    def add_to_server(self, server: grpc.Server) -> None:
        fedge_pb2_grpc.add_ModelDownloadServicer_to_server(self, server)
        fedge_pb2_grpc.add_ReportUploadServicer_to_server(self, server)
        fedge_pb2_grpc.add_DesiredSyncServicer_to_server(self, server)

    def server_options(self) -> list[tuple[str, int]]:
        # Let payloads somewhat over max_payload through gRPC so they get a polite
        # "too large" ack instead of killing the whole stream with RESOURCE_EXHAUSTED.
        limit = max(4 * 1024 * 1024, 4 * self.max_payload) + 64 * 1024
        return [("grpc.max_receive_message_length", limit)]

    def start(self, host: str, port: int, *, max_workers: int = 8) -> tuple[grpc.Server, int]:
        """Bind (port 0 picks a free one), start, and return the server and its port."""
        server = grpc.server(
            futures.ThreadPoolExecutor(max_workers=max_workers, thread_name_prefix="fedge-grpc"),
            options=self.server_options(),
        )
        self.add_to_server(server)
        address = f"{host}:{port}"
        bound = (
            server.add_insecure_port(address)
            if self.tls is None
            else server.add_secure_port(address, server_credentials(self.tls))
        )
        if bound == 0:
            raise OSError(f"cannot bind gRPC server to {host}:{port}")
        server.start()
        return server, bound

    # -- auth ---------------------------------------------------------------

    def _abort(
        self,
        context: grpc.ServicerContext,
        code: grpc.StatusCode,
        msg: str,
        counter: str | None = None,
    ) -> NoReturn:
        self._counters.incr(counter or code.name.lower())
        context.abort(code, msg)

    def _authenticated_edge(self, context: grpc.ServicerContext) -> str:
        try:
            return self._identity.edge(context.invocation_metadata(), context.auth_context())
        except identity.Refused as refused:
            self._abort(context, refused.code, str(refused))

    def _check_edge(self, context: grpc.ServicerContext, authed: str, claimed: str) -> None:
        if claimed != authed:
            msg = f"edge {claimed!r} in request, but authenticated as {authed!r}"
            self._abort(context, grpc.StatusCode.PERMISSION_DENIED, msg)

    # -- ModelDownload ------------------------------------------------------

    def _lookup(self, name: str, version: int) -> _Artifact:
        path = self.source.artifact_path(name, version)
        return _Artifact(
            manifest_envelope=self.source.manifest_envelope(name, version),
            path=path,
            sha256=self.source.artifact_sha256(name, version),
            size=path.stat().st_size,
        )

    def Download(  # method name fixed by the proto
        self, request: fedge_pb2.DownloadRequest, context: grpc.ServicerContext
    ) -> Iterator[fedge_pb2.DownloadChunk]:
        edge = self._authenticated_edge(context)
        self._check_edge(context, edge, request.edge)
        name, version, offset = request.model_name, request.model_version, request.offset
        try:
            art = self._lookup(name, version)
        except (LookupError, OSError) as exc:
            msg = f"unknown model {name!r} version {version}: {exc}"
            self._abort(context, grpc.StatusCode.NOT_FOUND, msg)
        if not 0 <= offset <= art.size:
            msg = f"offset {offset} outside 0..{art.size} for model {name!r} version {version}"
            self._abort(context, grpc.StatusCode.OUT_OF_RANGE, msg)
        chunk = request.chunk_size if request.chunk_size > 0 else self.chunk_size_default
        chunk = min(chunk, self.max_chunk)

        yield fedge_pb2.DownloadChunk(
            header=fedge_pb2.DownloadHeader(
                manifest_envelope=art.manifest_envelope,
                total_size=art.size,
                offset=offset,
                sha256=art.sha256,
            )
        )
        with art.path.open("rb") as f:
            f.seek(offset)
            remaining = art.size - offset
            while remaining > 0:
                data = f.read(min(chunk, remaining))
                if not data:
                    # The file shrank under us; the header promised more bytes.
                    context.abort(grpc.StatusCode.DATA_LOSS, f"artifact {name!r} truncated")
                remaining -= len(data)
                yield fedge_pb2.DownloadChunk(data=data)

    # -- ReportUpload -------------------------------------------------------

    def _ingest(self, edge: str, request: fedge_pb2.UploadRequest) -> fedge_pb2.UploadAck:
        rid, payload = request.request_id, request.payload
        if len(payload) > self.max_payload:
            self._counters.incr("oversized")
            error = f"payload too large ({len(payload)} bytes > {self.max_payload})"
            return fedge_pb2.UploadAck(request_id=rid, accepted=False, error=error)
        try:
            result = self.sink.ingest_payload(edge, payload)
        except Exception as exc:
            # One bad payload must not cost the edge the rest of its stream.
            log.exception("sink failed on payload %d from edge %r", rid, edge)
            self._counters.incr("sink_errors")
            error = f"sink error: {type(exc).__name__}: {exc}"
            return fedge_pb2.UploadAck(request_id=rid, accepted=False, error=error)
        if not result.accepted:
            self._counters.incr("rejected")
        return fedge_pb2.UploadAck(
            request_id=rid,
            accepted=result.accepted,
            duplicate=result.duplicate,
            error=result.error or "",
        )

    def Upload(  # method name fixed by the proto
        self, request_iterator: Iterator[fedge_pb2.UploadRequest], context: grpc.ServicerContext
    ) -> Iterator[fedge_pb2.UploadAck]:
        edge = self._authenticated_edge(context)
        for request in request_iterator:
            self._check_edge(context, edge, request.edge)
            yield self._ingest(edge, request)

    # -- DesiredSync --------------------------------------------------------

    def Fetch(  # method name fixed by the proto
        self, request: fedge_pb2.DesiredRequest, context: grpc.ServicerContext
    ) -> fedge_pb2.DesiredReply:
        edge = self._authenticated_edge(context)
        size = request.ByteSize()
        if size > MAX_DESIRED_REQUEST:
            msg = f"desired request too large ({size} bytes > {MAX_DESIRED_REQUEST})"
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, msg, "oversized")
        self._check_edge(context, edge, request.edge)
        known = {str(kind): int(version) for kind, version in request.known.items()}
        unknown = sorted(set(known) - set(DESIRED_KINDS))
        if unknown:
            msg = f"unknown desired kind(s) {', '.join(map(repr, unknown))}; known kinds: "
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, msg + ", ".join(DESIRED_KINDS))
        if any(version < 0 for version in known.values()):
            msg = f"known versions must be >= 0, got {known}"
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, msg)
        if self.desired is None:
            self._abort(context, grpc.StatusCode.UNIMPLEMENTED, "no desired documents here")
        try:
            latest = self.desired.latest_desired(edge)
        except Exception:
            log.exception("desired source failed for edge %r", edge)
            msg = "the manager could not read desired documents; retry later"
            self._abort(context, grpc.StatusCode.UNAVAILABLE, msg, "source_errors")
        return fedge_pb2.DesiredReply(
            envelopes=[
                fedge_pb2.DesiredEnvelope(kind=doc.kind, version=doc.version, envelope=doc.envelope)
                for doc in newer_than(latest, known)
            ]
        )

    def Report(  # method name fixed by the proto
        self, request: fedge_pb2.StatusReport, context: grpc.ServicerContext
    ) -> fedge_pb2.StatusAck:
        edge = self._authenticated_edge(context)
        self._check_edge(context, edge, request.edge)
        if request.kind not in STATUS_KINDS:
            msg = f"unknown status kind {request.kind!r:.40}; known kinds: " + ", ".join(
                STATUS_KINDS
            )
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, msg)
        if len(request.payload) > self.max_payload:
            msg = f"status payload too large ({len(request.payload)} bytes > {self.max_payload})"
            self._abort(context, grpc.StatusCode.INVALID_ARGUMENT, msg, "oversized")
        if self.status_sink is None:
            self._abort(context, grpc.StatusCode.UNIMPLEMENTED, "no status sink here")
        try:
            result = self.status_sink.ingest_status(edge, request.kind, bytes(request.payload))
        except Exception as exc:
            # Not the report's fault (e.g. the store is busy): the edge keeps it and retries.
            log.exception("status sink failed on a %s report from edge %r", request.kind, edge)
            msg = f"the manager could not store the report ({type(exc).__name__}); retry later"
            self._abort(context, grpc.StatusCode.UNAVAILABLE, msg, "sink_errors")
        if not result.accepted:
            self._counters.incr("rejected")
        return fedge_pb2.StatusAck(accepted=result.accepted, error=result.error or "")


def start_grpc_server(
    host: str,
    port: int,
    source: ArtifactSource,
    sink: ReportSink,
    authenticate: EdgeAuthenticator,
    max_workers: int = 8,
    chunk_size_default: int = 256 * 1024,
    max_chunk: int = 4 * 1024 * 1024,
    max_payload: int = 1 * 1024 * 1024,
    tls: TlsFiles | None = None,
) -> tuple[grpc.Server, int]:
    """Start the services; returns the running server and the bound port.

    Build a :class:`GrpcServices` and call its ``start`` instead when you need its
    ``counters`` or DesiredSync (here it answers UNIMPLEMENTED).
    """
    services = GrpcServices(
        source,
        sink,
        authenticate,
        chunk_size_default=chunk_size_default,
        max_chunk=max_chunk,
        max_payload=max_payload,
        tls=tls,
    )
    return services.start(host, port, max_workers=max_workers)

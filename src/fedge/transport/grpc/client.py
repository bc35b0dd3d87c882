"""Edge-side gRPC client: resumable model download, batched report upload, desired sync.

Checks nothing about content: the caller verifies the sha256 and the manifest
signature that :func:`download_artifact` returns and the envelopes that
:class:`DesiredClient` fetches, and owns retries.

Every client takes ``tls``: the station's certificate files (mutual TLS, issue 13; the
server knows the station by its certificate and no token is sent), or ``None`` for a
development manager run with ``--insecure`` (the station's token goes in metadata).
"""

from __future__ import annotations

import itertools
import os
import threading
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from pathlib import Path
from types import TracebackType
from typing import Self

import grpc

from fedge.protocols.grpc import fedge_pb2, fedge_pb2_grpc
from fedge.protocols.pki import TlsFiles
from fedge.transport.errors import TransportError
from fedge.transport.grpc.contract import DesiredDocument, SinkResult
from fedge.transport.grpc.identity import EDGE_KEY, TOKEN_KEY
from fedge.transport.grpc.tls import ChannelOptions, ClientChannel

PART_SUFFIX = ".part"
# Room for the header (manifest envelope) and protobuf framing around a data chunk.
_RECV_SLACK = 1024 * 1024


class DownloadError(TransportError):
    """A download failed; ``code`` is the gRPC status name when the server gave one."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class UploadError(TransportError):
    """An upload batch failed as a whole; ``code`` is the gRPC status name if any."""

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code


class SyncError(TransportError):
    """A DesiredSync call failed; ``code`` is the gRPC status name when the server gave one.

    ``INVALID_ARGUMENT`` means the request itself was refused (sending it again cannot
    help); anything else may pass on a later try.
    """

    def __init__(self, message: str, code: str | None = None) -> None:
        super().__init__(message)
        self.code = code

    @property
    def refused(self) -> bool:
        return self.code == grpc.StatusCode.INVALID_ARGUMENT.name


@dataclass(frozen=True)
class DownloadResult:
    manifest_envelope: bytes
    total_size: int
    sha256: str
    resumed_from: int


def _metadata(edge: str, token: str, tls: TlsFiles | None) -> tuple[tuple[str, str], ...]:
    # Under TLS the certificate is the credential: nothing secret travels in metadata.
    return () if tls is not None else ((EDGE_KEY, edge), (TOKEN_KEY, token))


def _open(
    target: str, tls: TlsFiles | None, error: type[TransportError], options: ChannelOptions = ()
) -> ClientChannel:
    try:
        return ClientChannel(target, tls, options)
    except OSError as exc:
        raise error(
            f"cannot read the station's TLS files for {target}: {exc}; "
            "enrol again with `fedge agent enroll`"
        ) from None


# A server that refuses our certificate closes the TLS handshake; gRPC only says the
# socket closed, so the station's log says what to check (the server logs the reason).
_HANDSHAKE_HINT = (
    " (if the manager is up, it refused this station's certificate: it must be from the "
    "fleet's CA, unexpired and not revoked; enrol again with `fedge agent enroll`)"
)


def _status(exc: grpc.RpcError, tls: TlsFiles | None) -> tuple[str | None, str]:
    """(status code name, "CODE: details") of an RpcError."""
    if isinstance(exc, grpc.Call):
        code = exc.code()
        name = code.name if code is not None else None
        details = str(exc.details())
        refused = "socket closed" in details.lower() or "handshake" in details.lower()
        hint = _HANDSHAKE_HINT if tls is not None and code is grpc.StatusCode.UNAVAILABLE else ""
        return name, f"{name}: {details}" + (hint if refused else "")
    return None, str(exc)


def _fsync_dir(path: Path) -> None:
    # Makes the rename itself durable, not just the file's bytes.
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def download_artifact(
    target: str,
    edge: str,
    token: str,
    name: str,
    version: int,
    dest: Path,
    *,
    chunk_size: int = 256 * 1024,
    timeout_s: float = 60.0,
    tls: TlsFiles | None = None,
) -> DownloadResult:
    """Download a model artifact to ``dest``, resuming from ``dest`` + ``.part``.

    Bytes go to the ``.part`` file, which is renamed to ``dest`` only once complete.
    A cut stream raises :class:`DownloadError` and keeps the ``.part`` so the next
    call resumes from its size.
    """
    part = dest.with_name(dest.name + PART_SUFFIX)
    dest.parent.mkdir(parents=True, exist_ok=True)
    offset = part.stat().st_size if part.exists() else 0
    what = f"download of {name!r} v{version} from {target}"
    options = [("grpc.max_receive_message_length", max(chunk_size, 4 * 1024 * 1024) + _RECV_SLACK)]
    request = fedge_pb2.DownloadRequest(
        edge=edge, model_name=name, model_version=version, offset=offset, chunk_size=chunk_size
    )
    have = offset
    channel = _open(target, tls, DownloadError, options)
    try:
        stub = fedge_pb2_grpc.ModelDownloadStub(channel.get())
        try:
            stream = stub.Download(request, timeout=timeout_s, metadata=_metadata(edge, token, tls))
            first = next(stream, None)
            if first is None or first.WhichOneof("kind") != "header":
                raise DownloadError(f"{what}: stream did not start with a header")
            header = first.header
            total = int(header.total_size)
            if header.offset != offset or total < offset:
                raise DownloadError(
                    f"{what}: server answered offset {header.offset}/{total}, asked {offset}"
                )
            with part.open("ab") as f:
                try:
                    for msg in stream:
                        if msg.WhichOneof("kind") != "data":
                            raise DownloadError(f"{what}: unexpected message after header")
                        have += len(msg.data)
                        if have > total:
                            raise DownloadError(f"{what}: server sent more than {total} bytes")
                        f.write(msg.data)
                finally:
                    # Whatever arrived stays on disk so a retry resumes after it.
                    f.flush()
                    os.fsync(f.fileno())
        except grpc.RpcError as exc:
            code, status = _status(exc, tls)
            if code == grpc.StatusCode.OUT_OF_RANGE.name and offset > 0:
                # The .part is longer than the artifact: it cannot be resumed.
                part.unlink(missing_ok=True)
                status += " (partial file discarded)"
            raise DownloadError(f"{what} failed at byte {have}: {status}", code) from exc
    finally:
        channel.close()
    if have != total:
        raise DownloadError(f"{what}: stream ended at byte {have} of {total}")
    os.replace(part, dest)
    _fsync_dir(dest.parent)
    return DownloadResult(
        manifest_envelope=bytes(header.manifest_envelope),
        total_size=total,
        sha256=str(header.sha256),
        resumed_from=offset,
    )


class _Channel:
    """One gRPC channel, closed by ``close()`` or at the end of a ``with`` block."""

    _channel: ClientChannel

    def close(self) -> None:
        self._channel.close()

    def __enter__(self) -> Self:
        return self

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.close()


class ReportUploader(_Channel):
    """Uploads record-batch payloads over one channel; one bidi call per batch."""

    def __init__(self, target: str, edge: str, token: str, *, tls: TlsFiles | None = None) -> None:
        self.target = target
        self.edge = edge
        self._metadata = _metadata(edge, token, tls)
        self._tls = tls
        self._channel = _open(target, tls, UploadError)
        self._ids = itertools.count(1)
        self._ids_lock = threading.Lock()

    def upload(self, payloads: Sequence[bytes], timeout_s: float = 30.0) -> list[SinkResult]:
        """Send ``payloads``; returns one result per payload, in the same order.

        Raises :class:`UploadError` if the call fails or ends before every payload is
        acked; the whole batch should then be resent (the sink flags duplicates).
        """
        with self._ids_lock:
            ids = [next(self._ids) for _ in payloads]
        requests = [
            fedge_pb2.UploadRequest(edge=self.edge, payload=p, request_id=i)
            for i, p in zip(ids, payloads, strict=True)
        ]
        wanted = set(ids)
        acks: dict[int, SinkResult] = {}
        try:
            stub = fedge_pb2_grpc.ReportUploadStub(self._channel.get())
            for ack in stub.Upload(iter(requests), timeout=timeout_s, metadata=self._metadata):
                rid = int(ack.request_id)
                if rid not in wanted:
                    raise UploadError(f"upload to {self.target}: ack for unknown request {rid}")
                acks[rid] = SinkResult(
                    accepted=bool(ack.accepted),
                    duplicate=bool(ack.duplicate),
                    error=str(ack.error) or None,
                )
        except grpc.RpcError as exc:
            code, status = _status(exc, self._tls)
            raise UploadError(
                f"upload of {len(ids)} payloads to {self.target}: {status}", code
            ) from exc
        except OSError as exc:  # the certificate files vanished under a renewal
            raise UploadError(f"upload to {self.target}: {exc}") from exc
        missing = [i for i in ids if i not in acks]
        if missing:
            raise UploadError(f"upload to {self.target}: no ack for {len(missing)} payloads")
        return [acks[i] for i in ids]


# A poll should find a manager that came back within a poll or two, not after gRPC's
# default reconnect backoff of up to two minutes.
_SYNC_CHANNEL_OPTIONS = [
    ("grpc.initial_reconnect_backoff_ms", 1000),
    ("grpc.max_reconnect_backoff_ms", 5000),
]


class DesiredClient(_Channel):
    """An edge's DesiredSync calls over one channel: fetch desired envelopes, send statuses."""

    def __init__(self, target: str, edge: str, token: str, *, tls: TlsFiles | None = None) -> None:
        self.target = target
        self.edge = edge
        self._metadata = _metadata(edge, token, tls)
        self._tls = tls
        self._channel = _open(target, tls, SyncError, _SYNC_CHANNEL_OPTIONS)

    def _stub(self) -> fedge_pb2_grpc.DesiredSyncStub:
        try:
            return fedge_pb2_grpc.DesiredSyncStub(self._channel.get())
        except OSError as exc:  # the certificate files vanished under a renewal
            raise SyncError(f"DesiredSync with {self.target}: {exc}") from exc

    def fetch(self, known: Mapping[str, int], timeout_s: float = 10.0) -> list[DesiredDocument]:
        """The newest desired documents above ``known`` (version per kind), unverified."""
        request = fedge_pb2.DesiredRequest(edge=self.edge, known=dict(known))
        try:
            reply = self._stub().Fetch(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            code, status = _status(exc, self._tls)
            raise SyncError(
                f"fetching desired documents from {self.target}: {status}", code
            ) from exc
        return [
            DesiredDocument(kind=str(e.kind), version=int(e.version), envelope=bytes(e.envelope))
            for e in reply.envelopes
        ]

    def report(self, kind: str, payload: bytes, timeout_s: float = 10.0) -> SinkResult:
        """Send one status document (``kind``: state, config or deploy)."""
        request = fedge_pb2.StatusReport(edge=self.edge, kind=kind, payload=payload)
        try:
            ack = self._stub().Report(request, timeout=timeout_s, metadata=self._metadata)
        except grpc.RpcError as exc:
            code, status = _status(exc, self._tls)
            raise SyncError(f"{kind} report to {self.target}: {status}", code) from exc
        return SinkResult(accepted=bool(ack.accepted), error=str(ack.error) or None)

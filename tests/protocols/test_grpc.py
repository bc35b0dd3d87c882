"""gRPC download/upload against a real server on 127.0.0.1 with in-test fakes."""

from __future__ import annotations

import hashlib
import os
import threading
from collections.abc import Callable, Iterator
from concurrent import futures
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
import pytest

from fedge.protocols.grpc import fedge_pb2, fedge_pb2_grpc
from fedge.transport.grpc.client import (
    PART_SUFFIX,
    DownloadError,
    ReportUploader,
    UploadError,
    download_artifact,
)
from fedge.transport.grpc.contract import SinkResult
from fedge.transport.grpc.server import (
    EDGE_KEY,
    TOKEN_KEY,
    GrpcServices,
    start_grpc_server,
)

pytestmark = pytest.mark.integration

EDGE = "edge-01"
TOKEN = "s3cret"
MODEL = "defect-detector"
CHUNK = 1024
ENVELOPE = b'{"manifest": "signed"}'
DOWNLOAD_METHOD = "/fedge.v1.ModelDownload/Download"


@dataclass
class FakeSource:
    artifacts: dict[tuple[str, int], Path] = field(default_factory=dict)

    def _path(self, name: str, version: int) -> Path:
        try:
            return self.artifacts[(name, version)]
        except KeyError:
            raise LookupError(f"no model {name} v{version}") from None

    def manifest_envelope(self, name: str, version: int) -> bytes:
        self._path(name, version)
        return ENVELOPE

    def artifact_path(self, name: str, version: int) -> Path:
        return self._path(name, version)

    def artifact_sha256(self, name: str, version: int) -> str:
        return hashlib.sha256(self._path(name, version).read_bytes()).hexdigest()


@dataclass
class FakeSink:
    seen: list[tuple[str, bytes]] = field(default_factory=list)

    def ingest_payload(self, edge: str, payload: bytes) -> SinkResult:
        if payload == b"boom":
            raise RuntimeError("disk on fire")
        duplicate = (edge, payload) in self.seen
        self.seen.append((edge, payload))
        return SinkResult(accepted=True, duplicate=duplicate)


def authenticate(edge: str, token: str) -> bool:
    return token == TOKEN and edge.startswith("edge-")


if TYPE_CHECKING:
    # Only the stubs make RpcMethodHandler generic; the runtime class is not subscriptable.
    from typing import TypeAlias

    Handler: TypeAlias = grpc.RpcMethodHandler[Any, Any]


class CutFirstDownload(grpc.ServerInterceptor):  # type: ignore[type-arg]
    """Aborts the first Download stream after ``after`` data chunks, like a dropped link."""

    def __init__(self, after: int) -> None:
        self.after = after
        self.armed = True
        self.lock = threading.Lock()

    def intercept_service(
        self,
        continuation: Callable[[grpc.HandlerCallDetails], Handler | None],
        handler_call_details: grpc.HandlerCallDetails,
    ) -> Handler | None:
        handler = continuation(handler_call_details)
        if handler is None or handler_call_details.method != DOWNLOAD_METHOD:
            return handler
        inner = handler.unary_stream
        assert inner is not None

        def cut(
            request: fedge_pb2.DownloadRequest, context: grpc.ServicerContext
        ) -> Iterator[fedge_pb2.DownloadChunk]:
            with self.lock:
                armed, self.armed = self.armed, False
            for sent, msg in enumerate(inner(request, context)):
                if armed and sent > self.after:  # message 0 is the header
                    context.abort(grpc.StatusCode.UNAVAILABLE, "link dropped by test")
                yield msg

        return grpc.unary_stream_rpc_method_handler(
            cut,
            request_deserializer=handler.request_deserializer,
            response_serializer=handler.response_serializer,
        )


@dataclass
class Running:
    services: GrpcServices
    target: str
    source: FakeSource
    sink: FakeSink
    artifact: bytes


def _artifact(tmp_path: Path) -> tuple[FakeSource, bytes]:
    data = os.urandom(10 * CHUNK + 123)  # not a multiple of the chunk size
    path = tmp_path / "store" / "model.onnx"
    path.parent.mkdir()
    path.write_bytes(data)
    return FakeSource({(MODEL, 3): path}), data


@pytest.fixture
def running(tmp_path: Path) -> Iterator[Running]:
    source, data = _artifact(tmp_path)
    sink = FakeSink()
    services = GrpcServices(source, sink, authenticate, chunk_size_default=CHUNK, max_payload=64)
    server, port = services.start("127.0.0.1", 0, max_workers=4)
    yield Running(services, f"127.0.0.1:{port}", source, sink, data)
    assert server.stop(grace=None).wait(timeout=10)


def test_full_download_equals_file(running: Running, tmp_path: Path) -> None:
    dest = tmp_path / "out" / "model.onnx"
    result = download_artifact(running.target, EDGE, TOKEN, MODEL, 3, dest, chunk_size=CHUNK)
    assert dest.read_bytes() == running.artifact
    assert not dest.with_name(dest.name + PART_SUFFIX).exists()
    assert result.manifest_envelope == ENVELOPE
    assert result.total_size == len(running.artifact)
    assert result.sha256 == hashlib.sha256(running.artifact).hexdigest()
    assert result.resumed_from == 0


def test_start_grpc_server_serves_with_defaults(tmp_path: Path) -> None:
    source, data = _artifact(tmp_path)
    server, port = start_grpc_server("127.0.0.1", 0, source, FakeSink(), authenticate)
    try:
        assert port > 0
        dest = tmp_path / "dl.bin"
        download_artifact(f"127.0.0.1:{port}", EDGE, TOKEN, MODEL, 3, dest, timeout_s=10)
        assert dest.read_bytes() == data
    finally:
        assert server.stop(grace=None).wait(timeout=10)


def test_cut_download_leaves_part_and_resumes(tmp_path: Path) -> None:
    source, data = _artifact(tmp_path)
    services = GrpcServices(source, FakeSink(), authenticate, chunk_size_default=CHUNK)
    server = grpc.server(
        futures.ThreadPoolExecutor(max_workers=4), interceptors=[CutFirstDownload(4)]
    )
    services.add_to_server(server)
    port = server.add_insecure_port("127.0.0.1:0")
    server.start()
    try:
        target = f"127.0.0.1:{port}"
        dest = tmp_path / "model.onnx"
        part = dest.with_name(dest.name + PART_SUFFIX)

        with pytest.raises(DownloadError) as cut:
            download_artifact(target, EDGE, TOKEN, MODEL, 3, dest, chunk_size=CHUNK, timeout_s=10)
        assert cut.value.code == "UNAVAILABLE"
        assert "link dropped by test" in str(cut.value)
        assert not dest.exists()
        assert part.read_bytes() == data[: 4 * CHUNK]

        result = download_artifact(
            target, EDGE, TOKEN, MODEL, 3, dest, chunk_size=CHUNK, timeout_s=10
        )
        assert result.resumed_from == 4 * CHUNK
        assert dest.read_bytes() == data
        assert not part.exists()
    finally:
        assert server.stop(grace=None).wait(timeout=10)


def test_complete_part_is_just_renamed(running: Running, tmp_path: Path) -> None:
    dest = tmp_path / "model.onnx"
    dest.with_name(dest.name + PART_SUFFIX).write_bytes(running.artifact)
    result = download_artifact(running.target, EDGE, TOKEN, MODEL, 3, dest)
    assert result.resumed_from == len(running.artifact)
    assert dest.read_bytes() == running.artifact


def test_part_longer_than_artifact_is_out_of_range_and_discarded(
    running: Running, tmp_path: Path
) -> None:
    dest = tmp_path / "model.onnx"
    part = dest.with_name(dest.name + PART_SUFFIX)
    part.write_bytes(running.artifact + b"junk")
    with pytest.raises(DownloadError) as err:
        download_artifact(running.target, EDGE, TOKEN, MODEL, 3, dest)
    assert err.value.code == "OUT_OF_RANGE"
    assert not part.exists()
    assert running.services.counters["out_of_range"] == 1
    # With the stale partial gone, the next attempt starts over and succeeds.
    assert download_artifact(running.target, EDGE, TOKEN, MODEL, 3, dest).resumed_from == 0
    assert dest.read_bytes() == running.artifact


def test_unknown_model_is_not_found_and_named(running: Running, tmp_path: Path) -> None:
    dest = tmp_path / "x.onnx"
    with pytest.raises(DownloadError) as err:
        download_artifact(running.target, EDGE, TOKEN, "no-such-model", 7, dest)
    assert err.value.code == "NOT_FOUND"
    assert "no-such-model" in str(err.value)
    assert not dest.exists()
    assert running.services.counters["not_found"] == 1


def test_bad_token_is_unauthenticated(running: Running, tmp_path: Path) -> None:
    with pytest.raises(DownloadError) as err:
        download_artifact(running.target, EDGE, "wrong", MODEL, 3, tmp_path / "m.onnx")
    assert err.value.code == "UNAUTHENTICATED"
    assert "UNAUTHENTICATED" in str(err.value)

    with ReportUploader(running.target, EDGE, "wrong") as up, pytest.raises(UploadError) as uerr:
        up.upload([b"{}"])
    assert uerr.value.code == "UNAUTHENTICATED"
    assert running.sink.seen == []
    assert running.services.counters["unauthenticated"] == 2


def test_edge_mismatch_is_denied(running: Running, tmp_path: Path) -> None:
    # Authenticated as edge-02 (valid token) but the requests claim to be EDGE.
    target = running.target
    channel = grpc.insecure_channel(target)
    try:
        stub = fedge_pb2_grpc.ModelDownloadStub(channel)
        meta = ((EDGE_KEY, "edge-02"), (TOKEN_KEY, TOKEN))
        req = fedge_pb2.DownloadRequest(edge=EDGE, model_name=MODEL, model_version=3)
        with pytest.raises(grpc.RpcError) as err:
            list(stub.Download(req, metadata=meta, timeout=10))
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED

        up_stub = fedge_pb2_grpc.ReportUploadStub(channel)
        ups = iter([fedge_pb2.UploadRequest(edge=EDGE, payload=b"{}", request_id=1)])
        with pytest.raises(grpc.RpcError) as uerr:
            list(up_stub.Upload(ups, metadata=meta, timeout=10))
        assert uerr.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        channel.close()
    assert running.sink.seen == []
    assert running.services.counters["permission_denied"] == 2


def test_normal_upload_is_accepted_and_duplicates_flagged(running: Running) -> None:
    with ReportUploader(running.target, EDGE, TOKEN) as up:
        acks = up.upload([b'{"batch": 1}', b'{"batch": 2}'])
        assert acks == [SinkResult(accepted=True), SinkResult(accepted=True)]
        again = up.upload([b'{"batch": 1}'])
    assert again == [SinkResult(accepted=True, duplicate=True)]
    first, second = (EDGE, b'{"batch": 1}'), (EDGE, b'{"batch": 2}')
    assert running.sink.seen == [first, second, first]


def test_oversized_payload_is_refused_and_counted(running: Running) -> None:
    big = b"x" * 100  # max_payload is 64 in the fixture
    with ReportUploader(running.target, EDGE, TOKEN) as up:
        acks = up.upload([big, b"{}"])
    assert acks[0].accepted is False
    assert acks[0].error == "payload too large (100 bytes > 64)"
    assert acks[1] == SinkResult(accepted=True)
    assert running.sink.seen == [(EDGE, b"{}")]
    assert running.services.counters["oversized"] == 1


def test_sink_exception_acks_error_and_stream_goes_on(running: Running) -> None:
    with ReportUploader(running.target, EDGE, TOKEN) as up:
        acks = up.upload([b"boom", b'{"ok": true}'])
        later = up.upload([b'{"later": true}'])
    assert acks[0].accepted is False
    assert acks[0].error is not None and "disk on fire" in acks[0].error
    assert acks[1] == SinkResult(accepted=True)
    assert later == [SinkResult(accepted=True)]
    assert running.services.counters["sink_errors"] == 1

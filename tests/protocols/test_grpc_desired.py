"""DesiredSync (issue 9) against a real gRPC server on 127.0.0.1 with in-test fakes."""

from __future__ import annotations

from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from fedge.protocols.grpc import fedge_pb2, fedge_pb2_grpc
from fedge.transport.grpc.client import DesiredClient, SyncError
from fedge.transport.grpc.contract import DesiredDocument, SinkResult, newer_than
from fedge.transport.grpc.server import EDGE_KEY, TOKEN_KEY, GrpcServices

pytestmark = pytest.mark.integration

EDGE = "edge-01"
TOKEN = "s3cret"
CONFIG = DesiredDocument("config", 3, b'{"signed": "config v3"}')
DEPLOY = DesiredDocument("deploy", 2, b'{"signed": "deploy v2"}')
LABELS = DesiredDocument("labels", 5, b'{"signed": "labels v5"}')


@dataclass
class FakeDesired:
    """Each edge's newest documents; another edge's are there to be not handed out."""

    docs: dict[str, list[DesiredDocument]] = field(
        default_factory=lambda: {
            EDGE: [LABELS, CONFIG, DEPLOY],
            "edge-02": [DesiredDocument("config", 9, b"edge-02's own")],
        }
    )
    fail: bool = False

    def latest_desired(self, edge: str) -> list[DesiredDocument]:
        if self.fail:
            raise RuntimeError("store locked")
        return self.docs.get(edge, [])


@dataclass
class FakeStatusSink:
    seen: list[tuple[str, str, bytes]] = field(default_factory=list)

    def ingest_status(self, edge: str, kind: str, payload: bytes) -> SinkResult:
        if payload == b"boom":
            raise RuntimeError("disk on fire")
        if not payload.startswith(b"{"):
            return SinkResult(accepted=False, error="not JSON")
        self.seen.append((edge, kind, payload))
        return SinkResult(accepted=True)


class NoArtifacts:
    def manifest_envelope(self, name: str, version: int) -> bytes:
        raise LookupError(name)

    def artifact_path(self, name: str, version: int) -> Path:
        raise LookupError(name)

    def artifact_sha256(self, name: str, version: int) -> str:
        raise LookupError(name)


class NoReports:
    def ingest_payload(self, edge: str, payload: bytes) -> SinkResult:
        return SinkResult(accepted=False, error="not here")


def authenticate(edge: str, token: str) -> bool:
    return token == TOKEN and edge.startswith("edge-")


@dataclass
class Running:
    services: GrpcServices
    target: str
    desired: FakeDesired
    sink: FakeStatusSink


@pytest.fixture
def running() -> Iterator[Running]:
    desired, sink = FakeDesired(), FakeStatusSink()
    services = GrpcServices(
        NoArtifacts(),
        NoReports(),
        authenticate,
        desired=desired,
        status_sink=sink,
        max_payload=64,
    )
    server, port = services.start("127.0.0.1", 0, max_workers=4)
    yield Running(services, f"127.0.0.1:{port}", desired, sink)
    assert server.stop(grace=None).wait(timeout=10)


@pytest.fixture
def client(running: Running) -> Iterator[DesiredClient]:
    with DesiredClient(running.target, EDGE, TOKEN) as desired_client:
        yield desired_client


def test_newer_than_keeps_what_the_edge_lacks_in_kind_order() -> None:
    latest = [LABELS, CONFIG, DEPLOY]
    assert newer_than(latest, {}) == [CONFIG, DEPLOY, LABELS]
    assert newer_than(latest, {"config": 3, "deploy": 1, "labels": 6}) == [DEPLOY]
    assert newer_than(latest, {"config": 3, "deploy": 2, "labels": 5}) == []


def test_fetch_returns_only_newer_envelopes_byte_for_byte(client: DesiredClient) -> None:
    assert client.fetch({}) == [CONFIG, DEPLOY, LABELS]
    assert client.fetch({"config": 2, "deploy": 2, "labels": 5}) == [CONFIG]
    assert client.fetch({"config": 3, "deploy": 2, "labels": 5}) == []


def test_an_edge_fetches_only_its_own_documents(running: Running) -> None:
    # edge-02's token is valid, but it asks for edge-01's documents.
    with DesiredClient(running.target, "edge-02", TOKEN) as other:
        assert other.fetch({}) == [DesiredDocument("config", 9, b"edge-02's own")]
    channel = grpc.insecure_channel(running.target)
    try:
        stub = fedge_pb2_grpc.DesiredSyncStub(channel)
        meta = ((EDGE_KEY, "edge-02"), (TOKEN_KEY, TOKEN))
        with pytest.raises(grpc.RpcError) as err:
            stub.Fetch(fedge_pb2.DesiredRequest(edge=EDGE), metadata=meta, timeout=10)
        assert err.value.code() == grpc.StatusCode.PERMISSION_DENIED
        with pytest.raises(grpc.RpcError) as rerr:
            report = fedge_pb2.StatusReport(edge=EDGE, kind="state", payload=b"{}")
            stub.Report(report, metadata=meta, timeout=10)
        assert rerr.value.code() == grpc.StatusCode.PERMISSION_DENIED
    finally:
        channel.close()
    assert running.sink.seen == []
    assert running.services.counters["permission_denied"] == 2


def test_a_bad_token_is_unauthenticated(running: Running) -> None:
    with DesiredClient(running.target, EDGE, "wrong") as bad:
        with pytest.raises(SyncError) as err:
            bad.fetch({})
        assert err.value.code == "UNAUTHENTICATED"
        with pytest.raises(SyncError) as rerr:
            bad.report("state", b"{}")
        assert rerr.value.code == "UNAUTHENTICATED"
    assert running.sink.seen == []
    assert running.services.counters["unauthenticated"] == 2


def test_malformed_fetches_are_refused_clearly_and_counted(
    running: Running, client: DesiredClient
) -> None:
    with pytest.raises(SyncError) as err:
        client.fetch({"config": 1, "firmware": 2})
    assert err.value.refused
    assert "unknown desired kind(s) 'firmware'; known kinds: trust, config, deploy" in str(
        err.value
    )
    with pytest.raises(SyncError) as neg:
        client.fetch({"config": -1})
    assert neg.value.refused and "known versions must be >= 0" in str(neg.value)
    assert running.services.counters["invalid_argument"] == 2


def test_an_oversized_fetch_is_refused_and_counted(running: Running) -> None:
    channel = grpc.insecure_channel(running.target)
    try:
        stub = fedge_pb2_grpc.DesiredSyncStub(channel)
        meta = ((EDGE_KEY, EDGE), (TOKEN_KEY, TOKEN))
        huge = fedge_pb2.DesiredRequest(edge=EDGE, known={f"k{i:05d}": i for i in range(1000)})
        with pytest.raises(grpc.RpcError) as err:
            stub.Fetch(huge, metadata=meta, timeout=10)
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT
        assert "desired request too large" in str(err.value.details())
    finally:
        channel.close()
    assert running.services.counters["oversized"] == 1


def test_a_failing_source_is_unavailable_so_the_edge_retries(
    running: Running, client: DesiredClient
) -> None:
    running.desired.fail = True
    with pytest.raises(SyncError) as err:
        client.fetch({})
    assert err.value.code == "UNAVAILABLE" and not err.value.refused
    assert running.services.counters["source_errors"] == 1
    running.desired.fail = False
    assert client.fetch({}) == [CONFIG, DEPLOY, LABELS]


def test_status_reports_reach_the_sink(running: Running, client: DesiredClient) -> None:
    assert client.report("state", b'{"state": 1}') == SinkResult(accepted=True)
    assert client.report("deploy", b'{"deploy": 1}') == SinkResult(accepted=True)
    assert running.sink.seen == [
        (EDGE, "state", b'{"state": 1}'),
        (EDGE, "deploy", b'{"deploy": 1}'),
    ]


def test_a_status_the_sink_rejects_is_an_answer_not_an_error(
    running: Running, client: DesiredClient
) -> None:
    assert client.report("config", b"garbage") == SinkResult(accepted=False, error="not JSON")
    assert running.services.counters["rejected"] == 1


def test_bad_status_reports_are_refused_clearly_and_counted(
    running: Running, client: DesiredClient
) -> None:
    with pytest.raises(SyncError) as kind:
        client.report("predictions", b"{}")  # record batches go through ReportUpload
    assert kind.value.refused
    assert "unknown status kind 'predictions'; known kinds: state, config, deploy" in str(
        kind.value
    )
    with pytest.raises(SyncError) as big:
        client.report("state", b"{" + b"x" * 100 + b"}")  # max_payload is 64 here
    assert big.value.refused and "status payload too large (102 bytes > 64)" in str(big.value)
    with pytest.raises(SyncError) as sink:
        client.report("state", b"boom")
    assert sink.value.code == "UNAVAILABLE" and not sink.value.refused
    counters = running.services.counters
    assert (counters["invalid_argument"], counters["oversized"], counters["sink_errors"]) == (
        1,
        1,
        1,
    )
    assert running.sink.seen == []


def test_without_a_desired_source_the_service_is_unimplemented() -> None:
    services = GrpcServices(NoArtifacts(), NoReports(), authenticate)
    server, port = services.start("127.0.0.1", 0, max_workers=2)
    try:
        with DesiredClient(f"127.0.0.1:{port}", EDGE, TOKEN) as bare:
            with pytest.raises(SyncError) as err:
                bare.fetch({})
            assert err.value.code == "UNIMPLEMENTED"
    finally:
        assert server.stop(grace=None).wait(timeout=10)

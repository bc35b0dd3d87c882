"""fedge's gRPC services over mutual TLS (issue 13): the station is its certificate.

Real gRPC servers on free ports, a fleet CA and certificates made with ``FleetCA`` in
``tmp_path``. A station with its certificate downloads, uploads and syncs; refused are a
client without a certificate, with one from another CA, an expired or revoked one (the
CRL rewritten under a running server), an operator's or the manager's certificate, and a
station naming another edge. Every refusal has its status code and message, is counted,
and stores nothing.
"""

from __future__ import annotations

import datetime as dt
import hashlib
import os
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

import grpc
import pytest

from fedge.protocols.fleet_ca import FleetCA, Revoked
from fedge.protocols.grpc import fedge_pb2, fedge_pb2_grpc
from fedge.protocols.pki import (
    CertificateError,
    Role,
    TlsFiles,
    cert_info,
    load_certificate,
    write_private,
)
from fedge.transport.grpc.client import (
    DesiredClient,
    DownloadError,
    ReportUploader,
    SyncError,
    UploadError,
    download_artifact,
)
from fedge.transport.grpc.contract import DesiredDocument, SinkResult
from fedge.transport.grpc.identity import EDGE_KEY, CertificateIdentity, Refused
from fedge.transport.grpc.server import GrpcServices

pytestmark = pytest.mark.integration

ST1, ST2 = "st-01", "st-02"
MODEL = "inspect"
CONFIG = DesiredDocument("config", 3, b'{"signed": "config v3 of st-01"}')
STATE = b'{"state": "online"}'


@dataclass
class Fakes:
    """The manager side, recording everything stored; nothing a refused call may touch."""

    artifact: Path
    stored: list[tuple[str, str, bytes]] = field(default_factory=list)

    def manifest_envelope(self, name: str, version: int) -> bytes:
        return b'{"signed": "manifest"}'

    def artifact_path(self, name: str, version: int) -> Path:
        if (name, version) != (MODEL, 1):
            raise LookupError(f"no model {name} v{version}")
        return self.artifact

    def artifact_sha256(self, name: str, version: int) -> str:
        return hashlib.sha256(self.artifact_path(name, version).read_bytes()).hexdigest()

    def ingest_payload(self, edge: str, payload: bytes) -> SinkResult:
        self.stored.append((edge, "records", payload))
        return SinkResult(accepted=True)

    def ingest_status(self, edge: str, kind: str, payload: bytes) -> SinkResult:
        self.stored.append((edge, kind, payload))
        return SinkResult(accepted=True)

    def latest_desired(self, edge: str) -> list[DesiredDocument]:
        return [CONFIG] if edge == ST1 else []


def no_token(edge: str, token: str) -> bool:
    raise AssertionError("under mutual TLS no token is checked")


@dataclass
class Fleet:
    root: Path
    ca: FleetCA
    crl: Path
    services: GrpcServices
    target: str
    fakes: Fakes

    def files(self, name: str, cert: bytes, key: bytes, ca_pem: bytes | None = None) -> TlsFiles:
        return write_files(self.root / name, cert, key, ca_pem or self.ca.cert_pem)

    def client(
        self,
        identity: str,
        role: Role = Role.EDGE,
        *,
        days: float = 90,
        now: dt.datetime | None = None,
    ) -> TlsFiles:
        cert, key = self.ca.issue_client(identity, role, days=days, now=now)
        return self.files(f"{identity}-{role.value}-{os.urandom(3).hex()}", cert, key)

    def revoke(self, *serials: int) -> None:
        at = dt.datetime.now(dt.UTC)
        tmp = self.crl.with_suffix(".tmp")
        tmp.write_bytes(self.ca.crl([Revoked(serial, at) for serial in serials]))
        os.replace(tmp, self.crl)  # as FleetPki.write_crl does

    def desired(self, tls: TlsFiles, edge: str = ST1) -> DesiredClient:
        return DesiredClient(self.target, edge, "", tls=tls)


def write_files(folder: Path, cert: bytes, key: bytes, ca_pem: bytes) -> TlsFiles:
    """A certificate and key (and the CA the holder trusts), as a station keeps them."""
    folder.mkdir(exist_ok=True)
    (folder / "ca.crt").write_bytes(ca_pem)
    (folder / "cert.pem").write_bytes(cert)
    write_private(folder / "key.pem", key)
    return TlsFiles(folder / "ca.crt", folder / "cert.pem", folder / "key.pem")


def serial(files: TlsFiles) -> int:
    return cert_info(load_certificate(files.cert.read_bytes())).serial


@pytest.fixture
def fleet(tmp_path: Path) -> Iterator[Fleet]:
    ca = FleetCA.create("plant-a")
    artifact = tmp_path / "model.onnx"
    artifact.write_bytes(os.urandom(70_000))
    fakes = Fakes(artifact)
    crl = tmp_path / "crl.pem"
    crl.write_bytes(ca.crl([]))
    server_cert, server_key = ca.issue_server("grpc", ["127.0.0.1", "localhost"])
    files = write_files(tmp_path / "server", server_cert, server_key, ca.cert_pem)
    services = GrpcServices(
        fakes,
        fakes,
        no_token,
        desired=fakes,
        status_sink=fakes,
        chunk_size_default=16_384,
        tls=TlsFiles(files.ca, files.cert, files.key, crl),
    )
    server, port = services.start("127.0.0.1", 0, max_workers=4)
    yield Fleet(tmp_path, ca, crl, services, f"127.0.0.1:{port}", fakes)
    assert server.stop(grace=None).wait(timeout=10)


def refusals(fleet: Fleet) -> dict[str, int]:
    counts = fleet.services.counters
    return {k: v for k, v in counts.items() if v}


# ------------------------------------------------------------------ a station works


def test_a_station_with_its_certificate_syncs_uploads_and_downloads(
    fleet: Fleet, tmp_path: Path
) -> None:
    station = fleet.client(ST1)
    with fleet.desired(station) as client:
        assert client.fetch({}) == [CONFIG]
        assert client.fetch({"config": 3}) == []
        assert client.report("state", STATE) == SinkResult(accepted=True)
    with ReportUploader(fleet.target, ST1, "", tls=station) as uploader:
        assert uploader.upload([b"batch-1", b"batch-2"]) == [SinkResult(accepted=True)] * 2
    dest = tmp_path / "got" / "model.onnx"
    result = download_artifact(fleet.target, ST1, "", MODEL, 1, dest, tls=station)
    assert dest.read_bytes() == fleet.fakes.artifact.read_bytes()
    assert result.sha256 == hashlib.sha256(dest.read_bytes()).hexdigest()
    assert fleet.fakes.stored == [
        (ST1, "state", STATE),
        (ST1, "records", b"batch-1"),
        (ST1, "records", b"batch-2"),
    ]
    assert refusals(fleet) == {}


# ------------------------------------------------------- refused at the handshake


def _raw_fetch(channel: grpc.Channel) -> grpc.RpcError:
    stub = fedge_pb2_grpc.DesiredSyncStub(channel)
    with pytest.raises(grpc.RpcError) as refused:
        stub.Fetch(fedge_pb2.DesiredRequest(edge=ST1), timeout=5)
    channel.close()
    return refused.value


def test_no_client_certificate_or_plain_tcp_is_refused(fleet: Fleet) -> None:
    trusting = grpc.ssl_channel_credentials(root_certificates=fleet.ca.cert_pem)
    for channel in (
        grpc.secure_channel(fleet.target, trusting),
        grpc.insecure_channel(fleet.target),
    ):
        error = _raw_fetch(channel)
        assert isinstance(error, grpc.Call)
        assert error.code() is grpc.StatusCode.UNAVAILABLE, error.details()
    assert fleet.fakes.stored == [] and refusals(fleet) == {}


def test_a_certificate_of_another_ca_is_refused(fleet: Fleet) -> None:
    stranger = FleetCA.create("plant-b")
    cert, key = stranger.issue_client(ST1, Role.EDGE)
    # It trusts our CA (so the server is accepted) but shows the other fleet's certificate.
    files = fleet.files("stranger", cert, key)
    with fleet.desired(files) as client, pytest.raises(SyncError) as refused:
        client.report("state", STATE)
    assert refused.value.code == "UNAVAILABLE"
    assert "refused this station's certificate" in str(refused.value)
    assert "fleet's CA, unexpired and not revoked" in str(refused.value)
    assert fleet.fakes.stored == [] and refusals(fleet) == {}


def test_an_expired_certificate_is_refused(fleet: Fleet, tmp_path: Path) -> None:
    past = dt.datetime.now(dt.UTC) - dt.timedelta(days=10)
    expired = fleet.client(ST1, days=1, now=past)
    with (
        ReportUploader(fleet.target, ST1, "", tls=expired) as uploader,
        pytest.raises(UploadError) as refused,
    ):
        uploader.upload([b"batch"], timeout_s=5)
    assert refused.value.code == "UNAVAILABLE"
    assert "refused this station's certificate" in str(refused.value)
    with pytest.raises(DownloadError) as download:
        download_artifact(fleet.target, ST1, "", MODEL, 1, tmp_path / "m.onnx", tls=expired)
    assert download.value.code == "UNAVAILABLE"
    assert not (tmp_path / "m.onnx").exists()
    assert fleet.fakes.stored == [] and refusals(fleet) == {}


def test_a_server_certificate_of_another_ca_is_not_trusted_by_the_station(
    fleet: Fleet,
) -> None:
    station = fleet.client(ST1)
    other_ca = FleetCA.create("plant-b").cert_pem
    files = fleet.files(
        "pinned-elsewhere", station.cert.read_bytes(), station.key.read_bytes(), other_ca
    )
    with fleet.desired(files) as client, pytest.raises(SyncError) as refused:
        client.fetch({}, timeout_s=5)
    assert refused.value.code == "UNAVAILABLE"
    assert fleet.fakes.stored == [] and refusals(fleet) == {}


# ------------------------------------------------------------ refused by the server


def test_a_revoked_certificate_is_refused_without_a_restart(fleet: Fleet) -> None:
    st1, st2 = fleet.client(ST1), fleet.client(ST2)
    with fleet.desired(st1) as client, fleet.desired(st2, ST2) as other:
        assert client.fetch({}) == [CONFIG]
        fleet.revoke(serial(st1))
        # The very next call on the same connection is refused.
        with pytest.raises(SyncError) as refused:
            client.report("state", STATE)
        assert refused.value.code == "UNAUTHENTICATED"
        assert f"certificate revoked: {ST1!r}" in str(refused.value)
        with pytest.raises(SyncError):
            client.fetch({})
        assert other.report("state", STATE).accepted  # st-02 is not revoked
    with ReportUploader(fleet.target, ST1, "", tls=st1) as uploader:
        with pytest.raises(UploadError) as upload:
            uploader.upload([b"batch"])
        assert upload.value.code == "UNAUTHENTICATED"
    assert fleet.fakes.stored == [(ST2, "state", STATE)]
    assert refusals(fleet) == {"unauthenticated": 3}


def test_an_operator_or_manager_certificate_is_no_station(fleet: Fleet) -> None:
    for role in (Role.OPERATOR, Role.MANAGER):
        # Even one whose common name is the station's.
        files = fleet.client(ST1, role)
        with fleet.desired(files) as client, pytest.raises(SyncError) as refused:
            client.report("state", STATE)
        assert refused.value.code == "PERMISSION_DENIED"
        assert f"certificate of role {role.value}" in str(refused.value)
        assert "only a station's own edge certificate" in str(refused.value)
    assert fleet.fakes.stored == []
    assert refusals(fleet) == {"permission_denied": 2}


def test_a_station_cannot_act_as_another(fleet: Fleet, tmp_path: Path) -> None:
    st1 = fleet.client(ST1)
    with fleet.desired(st1, ST2) as client:  # st-01's certificate, st-02 in the requests
        for call in (lambda: client.fetch({}), lambda: client.report("state", STATE)):
            with pytest.raises(SyncError) as refused:
                call()
            assert refused.value.code == "PERMISSION_DENIED"
            assert f"edge {ST2!r} in request, but authenticated as {ST1!r}" in str(refused.value)
    with ReportUploader(fleet.target, ST2, "", tls=st1) as uploader:
        with pytest.raises(UploadError) as upload:
            uploader.upload([b"st-02's records"])
        assert upload.value.code == "PERMISSION_DENIED"
    with pytest.raises(DownloadError) as download:
        download_artifact(fleet.target, ST2, "", MODEL, 1, tmp_path / "m.onnx", tls=st1)
    assert download.value.code == "PERMISSION_DENIED"
    # Metadata naming another edge is refused too, even with its own edge in the request.
    ca, cert, key = st1.read()
    credentials = grpc.ssl_channel_credentials(ca, key, cert)
    with grpc.secure_channel(fleet.target, credentials) as channel:
        stub = fedge_pb2_grpc.DesiredSyncStub(channel)
        with pytest.raises(grpc.RpcError) as meta:
            stub.Fetch(fedge_pb2.DesiredRequest(edge=ST1), timeout=5, metadata=((EDGE_KEY, ST2),))
    assert isinstance(meta.value, grpc.Call)
    assert meta.value.code() is grpc.StatusCode.PERMISSION_DENIED
    assert f"edge {ST2!r} in metadata, but the certificate is {ST1!r}'s" in str(
        meta.value.details()
    )
    assert fleet.fakes.stored == [] and not (tmp_path / "m.onnx").exists()
    assert refusals(fleet) == {"permission_denied": 5}


def test_an_unreadable_crl_refuses_everyone_until_fixed(fleet: Fleet) -> None:
    station = fleet.client(ST1)
    fleet.crl.write_bytes(b"-----BEGIN X509 CRL-----\ngarbage\n-----END X509 CRL-----\n")
    with fleet.desired(station) as client:
        with pytest.raises(SyncError) as refused:
            client.report("state", STATE)
        assert refused.value.code == "UNAVAILABLE"
        assert "cannot read its revocation list" in str(refused.value)
        fleet.revoke()  # a good, empty CRL again
        assert client.report("state", STATE).accepted
    assert fleet.fakes.stored == [(ST1, "state", STATE)]


def test_a_bad_crl_stops_the_server_from_starting(tmp_path: Path, fleet: Fleet) -> None:
    bad = tmp_path / "bad-crl.pem"
    bad.write_bytes(b"not a CRL")
    files = fleet.client(ST1)  # any pair will do: the CRL is read first
    with pytest.raises(CertificateError, match=r"bad-crl\.pem is not usable"):
        GrpcServices(
            fleet.fakes, fleet.fakes, no_token, tls=TlsFiles(files.ca, files.cert, files.key, bad)
        )
    with pytest.raises(CertificateError, match="cannot read the CRL"):
        GrpcServices(
            fleet.fakes,
            fleet.fakes,
            no_token,
            tls=TlsFiles(files.ca, files.cert, files.key, tmp_path / "none"),
        )


# ----------------------------------------------------------------- the station's side


def test_a_renewed_certificate_is_used_without_a_new_client(fleet: Fleet) -> None:
    station = fleet.client(ST1)
    old_serial = serial(station)
    with fleet.desired(station) as client:
        assert client.fetch({}) == [CONFIG]
        cert, key = fleet.ca.issue_client(ST1, Role.EDGE)
        write_private(station.key, key)
        station.cert.write_bytes(cert)
        fleet.revoke(old_serial)  # the old certificate is gone for good
        assert client.report("state", STATE).accepted
    assert fleet.fakes.stored == [(ST1, "state", STATE)]
    assert refusals(fleet) == {}


def test_missing_tls_files_are_a_clear_client_error(fleet: Fleet, tmp_path: Path) -> None:
    missing = TlsFiles(tmp_path / "ca.crt", tmp_path / "cert.pem", tmp_path / "key.pem")
    with pytest.raises(
        SyncError, match=r"cannot read the station's TLS files .*`fedge agent enroll`"
    ):
        fleet.desired(missing)
    with pytest.raises(UploadError, match="cannot read the station's TLS files"):
        ReportUploader(fleet.target, ST1, "", tls=missing)
    with pytest.raises(DownloadError, match="cannot read the station's TLS files"):
        download_artifact(fleet.target, ST1, "", MODEL, 1, tmp_path / "m.onnx", tls=missing)


# -------------------------------------------------------------- the pure identity rules


def test_certificate_identity_refuses_calls_without_a_usable_certificate() -> None:
    identity = CertificateIdentity(None)
    contexts: list[dict[str, object]] = [{}, {"x509_pem_cert": []}, {"x509_pem_cert": "t"}]
    for context in contexts:
        with pytest.raises(Refused, match="no client certificate") as refused:
            identity.edge((), context)
        assert refused.value.code is grpc.StatusCode.UNAUTHENTICATED
    with pytest.raises(Refused, match="client certificate: not a PEM certificate"):
        identity.edge((), {"x509_pem_cert": [b"junk"]})
    ca = FleetCA.create("plant-a")
    cert, _ = ca.issue_client(ST1, Role.EDGE)
    assert identity.edge((), {"x509_pem_cert": [cert]}) == ST1
    assert identity.edge(((EDGE_KEY, ST1.encode()),), {"x509_pem_cert": [cert]}) == ST1

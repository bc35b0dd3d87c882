"""`fedge agent enroll`: the device's half of enrollment (issue 13).

1. Fetch the fleet CA from the enrollment endpoint without trusting anything yet, and
   keep it only if its SHA-256 is the one the token carries (the token came from the
   manager by a channel a person trusts, as kubeadm's join pins the cluster CA).
2. Make the station's key here; send a CSR with the token over TLS verified against that
   CA (hostname checked). The key never leaves this device.
3. Write the key (0600), the certificate, the CA and an agent.toml holding no secret.
"""

import json
import ssl
import urllib.error
import urllib.request
from dataclasses import dataclass
from pathlib import Path

from fedge.edge_agent.errors import SettingsError
from fedge.privacy.floor import default_floor, floor_toml
from fedge.protocols import codec, pki, validate
from fedge.protocols.enrollment import EnrollRequest, EnrollResponse, JoinToken
from fedge.protocols.errors import ProtocolError
from fedge.protocols.pki import TlsFiles

AGENT_KEY, AGENT_CERT, AGENT_CA = "agent.key", "agent.crt", "ca.crt"
TIMEOUT_S = 15.0


class EnrollmentRefused(SettingsError):
    """The manager refused (token used, expired, issued for another edge, bad CSR), or
    it could not be trusted (the CA does not match the token's pin)."""


@dataclass(frozen=True)
class Enrolled:
    config: Path
    tls: TlsFiles
    response: EnrollResponse


def _fetch_ca(url: str, pin: str) -> bytes:
    # Unverified on purpose: nothing is trusted until the fingerprint matches the pin.
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.check_hostname = False
    context.verify_mode = ssl.CERT_NONE
    try:
        with urllib.request.urlopen(f"{url}/v1/ca", context=context, timeout=TIMEOUT_S) as reply:
            ca_pem = bytes(reply.read(pki.MAX_PEM_BYTES + 1))
    except (urllib.error.URLError, OSError) as exc:
        raise EnrollmentRefused(f"cannot reach the enrollment endpoint {url}: {exc}") from None
    try:
        found = pki.fingerprint(pki.load_certificate(ca_pem)).removeprefix("sha256:")
    except pki.CertificateError as exc:
        raise EnrollmentRefused(f"{url} sent no CA certificate: {exc}") from None
    if found != pin:
        raise EnrollmentRefused(
            f"the CA at {url} is {found[:16]}..., not the {pin[:16]}... the token names: "
            "not this fleet's manager (or a machine in between); nothing was sent"
        )
    return ca_pem


def refusal(exc: urllib.error.HTTPError) -> str:
    """The enrollment endpoint's one-line reason for refusing (its JSON ``message``)."""
    try:
        return str(json.loads(exc.read(4096)).get("message", ""))
    except (ValueError, AttributeError, OSError):
        return ""


def exchange(url: str, request: object, context: ssl.SSLContext, what: str) -> EnrollResponse:
    """POST ``request`` (a wire message) to the enrollment endpoint ``url`` over
    ``context``; the manager's EnrollResponse, or :class:`EnrollmentRefused` naming
    ``what`` ("enrollment", "renewal") with the manager's reason."""
    http_request = urllib.request.Request(
        url,
        data=codec.encode(request),
        headers={"Content-Type": "application/json"},
        method="POST",
    )
    try:
        with urllib.request.urlopen(http_request, context=context, timeout=TIMEOUT_S) as reply:
            body = bytes(reply.read(64 * 1024))
    except urllib.error.HTTPError as exc:
        raise EnrollmentRefused(f"{what} refused ({exc.code}): {refusal(exc)}") from None
    except (urllib.error.URLError, OSError) as exc:
        raise EnrollmentRefused(f"{what} at {url} failed: {exc}") from None
    try:
        return codec.decode(body, EnrollResponse, max_bytes=64 * 1024)
    except ProtocolError as exc:
        raise EnrollmentRefused(f"the {what} reply is malformed: {exc}") from None


def _agent_toml(
    response: EnrollResponse, tls: TlsFiles, data_dir: Path, url: str, privacy_floor: bool
) -> str:
    return "\n".join(
        [
            f'fleet = "{response.fleet}"',
            f'edge = "{response.edge}"',
            f'data_dir = "{data_dir}"',
            f'broker_host = "{response.broker_host}"',
            f"broker_port = {response.broker_port}",
            f'ca_file = "{tls.ca}"',
            f'cert_file = "{tls.cert}"',
            f'key_file = "{tls.key}"',
            f'grpc_target = "{response.grpc_target}"',
            f'superlink = "{response.superlink}"',
            f'enroll_url = "{url}"',
            f'manager_public_key = "{response.manager_public_key}"',
            *(
                []
                if response.manager_root_key is None
                else [f'manager_root_key = "{response.manager_root_key}"']
            ),
            f'watch_dir = "{data_dir / "inbox"}"',
            "http_port = 0",
            # The station's own floor (issue 24): the default unless opted out explicitly.
            *floor_toml(default_floor(5000) if privacy_floor else None),
            "",
        ]
    )


def enroll_device(
    manager_url: str,
    edge: str,
    token: str,
    config: Path,
    data_dir: Path | None = None,
    *,
    privacy_floor: bool = True,
) -> Enrolled:
    """Enrol this device as ``edge``; write its credentials and ``config`` (agent.toml)."""
    try:
        validate.identifier(edge, "edge")
        join = JoinToken.parse(token)
    except ProtocolError as exc:
        raise EnrollmentRefused(str(exc)) from None
    url = manager_url.rstrip("/")
    if not url.startswith("https://"):
        url = "https://" + url
    if config.exists():
        raise EnrollmentRefused(f"{config} exists; this device is enrolled already")
    ca_pem = _fetch_ca(url, join.ca_sha256)
    key_pem, csr_pem = pki.new_key_and_csr(edge)
    context = ssl.create_default_context(cadata=ca_pem.decode())
    request = EnrollRequest(edge, join.secret, csr_pem.decode())
    response = exchange(f"{url}/v1/enroll", request, context, "enrollment")
    if response.edge != edge:
        raise EnrollmentRefused(f"the manager issued a certificate for {response.edge!r}")
    folder = config.parent.resolve()
    tls = TlsFiles(ca=folder / AGENT_CA, cert=folder / AGENT_CERT, key=folder / AGENT_KEY)
    issued = pki.load_certificate(response.certificate.encode())
    if pki.cert_info(issued).identity != edge or issued.public_key() != (
        pki.load_key(key_pem).public_key()
    ):
        raise EnrollmentRefused("the certificate returned is not for this device's key")
    folder.mkdir(parents=True, exist_ok=True)
    pki.write_private(tls.key, key_pem)
    tls.cert.write_text(response.certificate)
    tls.ca.write_bytes(ca_pem)
    directory = (data_dir or folder / "data").resolve()
    config.write_text(_agent_toml(response, tls, directory, url, privacy_floor))
    return Enrolled(config, tls, response)

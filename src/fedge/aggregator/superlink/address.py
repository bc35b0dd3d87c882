"""Where a client on this machine reaches the fleet's SuperLink, and how it names it.

The SuperLink (:mod:`fedge.aggregator.superlink.link`) binds a host and port; Flower's own
SuperExec and ServerApps, the ``flwr`` CLI and ``fedge`` reach it on the local address
below, over HTTPS only if the server certificate names that host, through a ``flwr``
connection file naming the SuperLink.
"""

import ipaddress
import json
import re
import socket
from pathlib import Path

from cryptography import x509

_CONNECTION_NAME = re.compile(r"^[A-Za-z0-9_-]{1,64}$")


def port_open(host: str, port: int) -> bool:
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as sock:
        sock.settimeout(0.5)
        return sock.connect_ex((host, port)) == 0


def local_host(host: str) -> str:
    """Where a client on this machine reaches a server bound to ``host`` (Flower's own
    SuperExec does the same: a wildcard bind is reached on loopback)."""
    return {"0.0.0.0": "127.0.0.1", "::": "::1", "[::]": "::1", "": "127.0.0.1"}.get(host, host)


def connection_toml(name: str, address: str, root_certificates: Path | None) -> str:
    """The ``flwr`` CLI's ``FLWR_HOME/config.toml`` naming one SuperLink connection: HTTPS
    trusting ``root_certificates`` (the fleet CA), or plain HTTP when it is None."""
    if not _CONNECTION_NAME.match(name):
        raise ValueError(f"connection name {name!r}: letters, digits, - and _ only")
    # JSON strings are TOML basic strings (both escape quotes, backslashes and controls).
    lines = [
        "[superlink]",
        f"default = {json.dumps(name)}",
        "",
        f"[superlink.{name}]",
        f"address = {json.dumps(address)}",
        "insecure = true"
        if root_certificates is None
        else f"root-certificates = {json.dumps(str(root_certificates))}",
    ]
    return "\n".join(lines) + "\n"


def certificate_names_host(cert_pem: bytes, host: str) -> bool:
    """Whether the certificate's subject alternative names cover ``host`` (a name or IP)."""
    cert = x509.load_pem_x509_certificate(cert_pem)
    try:
        names = cert.extensions.get_extension_for_class(x509.SubjectAlternativeName).value
    except x509.ExtensionNotFound:
        return False
    bare = host.strip("[]")
    try:
        return ipaddress.ip_address(bare) in names.get_values_for_type(x509.IPAddress)
    except ValueError:
        return bare.lower() in (n.lower() for n in names.get_values_for_type(x509.DNSName))

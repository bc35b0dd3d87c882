"""The SuperLink's and SuperNodes' security settings, decided without a network (issue 13).

What Flower is told (flags, the ``flwr`` CLI's connection), how a station's TLS key
becomes the key Flower's SuperNode authentication signs with, which keys to (un)register,
and the bad input refused before any process starts. The real processes are in
tests/federation/test_superlink_tls.py.
"""

import tomllib
from pathlib import Path

import pytest
from cryptography.hazmat.primitives import serialization
from cryptography.hazmat.primitives.asymmetric import ed25519
from flwr.supercore.primitives.asymmetric import (
    public_key_to_bytes,
    sign_message,
    verify_signature,
)

from fedge.aggregator.superlink.address import certificate_names_host, connection_toml
from fedge.aggregator.superlink.link import (
    AuthorizedNode,
    SuperLink,
    SuperLinkError,
    node_public_key,
    plan_sync,
)
from fedge.edge_agent.training.supervisor import (
    SupernodeSpec,
    exit_reason,
    openssh_private_key,
    supernode_command,
)
from fedge.protocols.fleet_ca import FleetCA
from fedge.protocols.pki import Role, TlsFiles, new_key_and_csr, write_private

BIN = Path("/opt/bin")


def spec(root_certificates: Path | None = None, auth_key: Path | None = None) -> SupernodeSpec:
    return SupernodeSpec(
        "10.0.0.5:9092",
        "st-01",
        Path("/data"),
        20,
        1,
        60.0,
        root_certificates=root_certificates,
        auth_key=auth_key,
    )


def link_files(tmp_path: Path, hosts: list[str]) -> TlsFiles:
    ca = FleetCA.create("plant-a")
    (tmp_path / "ca.crt").write_bytes(ca.cert_pem)
    cert, key = ca.issue_server("superlink", hosts)
    (tmp_path / "superlink.crt").write_bytes(cert)
    write_private(tmp_path / "superlink.key", key)
    return TlsFiles(tmp_path / "ca.crt", tmp_path / "superlink.crt", tmp_path / "superlink.key")


# ---------------------------------------------------------------- the SuperNode's command


def test_a_supernode_with_the_fleet_ca_and_its_key_speaks_tls_and_signs() -> None:
    tls = spec(root_certificates=Path("/etc/fedge/ca.crt"), auth_key=Path("/etc/fedge/st.key"))
    command = supernode_command(tls, BIN, 40001, Path("/w/node.toml"), Path("/w/node-auth.key"))
    assert command[:5] == [
        "/opt/bin/flower-supernode",
        "--root-certificates", "/etc/fedge/ca.crt",
        "--auth-supernode-private-key", "/w/node-auth.key",
    ]  # fmt: skip
    assert "--insecure" not in command
    assert command[command.index("--superlink") + 1] == "10.0.0.5:9092"


def test_a_supernode_with_the_ca_only_speaks_tls_without_node_auth() -> None:
    command = supernode_command(spec(root_certificates=Path("/ca.crt")), BIN, 1, Path("/n"))
    assert command[1:3] == ["--root-certificates", "/ca.crt"]
    assert "--insecure" not in command and "--auth-supernode-private-key" not in command


def test_a_supernode_without_a_ca_is_plain_for_development() -> None:
    command = supernode_command(spec(), BIN, 1, Path("/n"))
    assert command[1] == "--insecure" and "--root-certificates" not in command


def test_node_auth_without_tls_and_a_missing_converted_key_are_refused() -> None:
    with pytest.raises(ValueError, match="needs TLS"):
        spec(auth_key=Path("/st.key"))
    with pytest.raises(ValueError, match="auth_key_file"):
        supernode_command(
            spec(root_certificates=Path("/ca"), auth_key=Path("/k")), BIN, 1, Path("/n")
        )
    with pytest.raises(ValueError, match="auth_key_file"):
        supernode_command(spec(root_certificates=Path("/ca")), BIN, 1, Path("/n"), Path("/k"))


def test_a_refused_supernode_is_explained_from_flower_exit_code_in_its_log() -> None:
    tail = (
        "ERROR :     Exit Code: 305\nFailed to initialize the connection to the SuperLink.\n"
        "[code: 2004] Failed to activate SuperNode.\n"
    )
    # The code alone does not say why (issue 27): the lines above it do, and the
    # supervisor reads those (fedge.edge_agent.training.causes).
    assert exit_reason(tail).startswith(", Flower exit code 305: the connection to the")
    assert "revoked" not in exit_reason(tail) and "TLS" not in exit_reason(tail)
    assert exit_reason("Exit Code: 303\n...\nExit Code: 999\n") == ", Flower exit code 999"
    assert exit_reason("INFO : SuperNode terminated gracefully.\n") == ""
    # An earlier start's code is not this one's.
    assert (
        exit_reason(f"--- t0: flower-supernode\n{tail}\n--- t1: flower-supernode\nKilled\n") == ""
    )


# ---------------------------------------------------------------- the station's key


def test_the_station_tls_key_is_the_node_key_flower_signs_and_verifies_with() -> None:
    """Flower reads an OpenSSH key: the station's P-256 key re-encoded signs what the
    public key in its certificate (as registered) verifies."""
    ca = FleetCA.create("plant-a")
    key_pem, csr = new_key_and_csr("st-01")
    cert = ca.sign_csr(csr, identity="st-01", role=Role.EDGE)
    private = serialization.load_ssh_private_key(openssh_private_key(key_pem), None)
    registered = serialization.load_ssh_public_key(node_public_key(cert).encode())
    assert node_public_key(cert).startswith("ecdsa-sha2-nistp256 ")
    signature = sign_message(private, b"2026-01-01T00:00:00+00:00")  # type: ignore[arg-type]
    assert verify_signature(registered, b"2026-01-01T00:00:00+00:00", signature)  # type: ignore[arg-type]
    assert public_key_to_bytes(private.public_key()) == public_key_to_bytes(registered)  # type: ignore[arg-type]


def test_keys_flower_cannot_use_are_refused_with_a_reason() -> None:
    ed = ed25519.Ed25519PrivateKey.generate()
    ed_pem = ed.private_bytes(
        serialization.Encoding.PEM, serialization.PrivateFormat.PKCS8, serialization.NoEncryption()
    )
    ed_public = ed.public_key().public_bytes(
        serialization.Encoding.PEM, serialization.PublicFormat.SubjectPublicKeyInfo
    )
    with pytest.raises(ValueError, match="ECDSA"):
        openssh_private_key(ed_pem)
    with pytest.raises(ValueError, match="PEM private key"):
        openssh_private_key(b"not a key")
    with pytest.raises(SuperLinkError, match="NIST curve"):
        node_public_key(ed_public)
    with pytest.raises(SuperLinkError, match="PEM"):
        node_public_key(b"-----BEGIN CERTIFICATE-----\nnope\n-----END CERTIFICATE-----\n")


def test_authorize_refuses_a_malformed_key_before_asking_the_superlink(tmp_path: Path) -> None:
    link = SuperLink(tmp_path / "sl", "127.0.0.1", 1, tls=link_files(tmp_path, ["127.0.0.1"]))
    with pytest.raises(SuperLinkError, match="OpenSSH public key"):
        link.authorize("st-01", "ssh-rsa garbage")
    with pytest.raises(SuperLinkError, match="NIST curve"):
        ed = ed25519.Ed25519PrivateKey.generate().public_key()
        line = ed.public_bytes(serialization.Encoding.OpenSSH, serialization.PublicFormat.OpenSSH)
        link.authorize("st-01", line.decode())
    assert link.authorized() == {}


def test_a_plain_superlink_cannot_register_keys(tmp_path: Path) -> None:
    _, csr = new_key_and_csr("st-01")
    cert = FleetCA.create("plant-a").sign_csr(csr, identity="st-01")
    link = SuperLink(tmp_path / "sl", "127.0.0.1", 1)
    assert not link.node_auth
    with pytest.raises(SuperLinkError, match="needs TLS"):
        link.authorize("st-01", node_public_key(cert))


# ---------------------------------------------------------------- which keys to (un)register


def test_sync_adds_the_new_removes_the_gone_and_replaces_a_changed_key() -> None:
    current = {
        "st-01": AuthorizedNode("st-01", 1, "ecdsa k1"),
        "st-02": AuthorizedNode("st-02", 2, "ecdsa k2"),
        "st-03": AuthorizedNode("st-03", 3, "ecdsa k3"),
    }
    wanted = {"st-01": "ecdsa k1", "st-03": "ecdsa k3-renewed", "st-04": "ecdsa k4"}
    assert plan_sync(current, wanted) == (["st-03", "st-04"], ["st-02", "st-03"])
    assert plan_sync(current, {n: v.public_key for n, v in current.items()}) == ([], [])
    assert plan_sync({}, {}) == ([], [])


# ---------------------------------------------------------------- the SuperLink's command


def test_a_tls_superlink_gets_its_certificate_and_authenticates_supernodes(tmp_path: Path) -> None:
    tls = link_files(tmp_path, ["127.0.0.1", "localhost"])
    command = SuperLink(tmp_path / "sl", "0.0.0.0", 9092, tls=tls).command()
    assert "--insecure" not in command
    for flag, path in (
        ("--ssl-ca-certfile", tls.ca),
        ("--ssl-certfile", tls.cert),
        ("--ssl-keyfile", tls.key),
    ):
        assert command[command.index(flag) + 1] == str(path)
    assert "--enable-supernode-auth" in command
    no_auth = SuperLink(tmp_path / "sl", "0.0.0.0", 9092, tls=tls, node_auth=False).command()
    assert "--enable-supernode-auth" not in no_auth and "--ssl-certfile" in no_auth
    plain = SuperLink(tmp_path / "sl", "127.0.0.1", 9092).command()
    assert "--insecure" in plain and "--enable-supernode-auth" not in plain


def test_a_certificate_not_naming_the_host_or_missing_files_stop_the_start(tmp_path: Path) -> None:
    tls = link_files(tmp_path, ["superlink.plant-a.example"])
    assert certificate_names_host(tls.cert.read_bytes(), "SUPERLINK.plant-a.example")
    assert not certificate_names_host(tls.cert.read_bytes(), "127.0.0.1")
    with pytest.raises(SuperLinkError, match=r"does not name 127\.0\.0\.1"):
        SuperLink(tmp_path / "a", "0.0.0.0", 1, tls=tls).start()
    gone = TlsFiles(tls.ca, tmp_path / "missing.crt", tls.key)
    with pytest.raises(SuperLinkError, match=r"certificate .*missing\.crt is missing"):
        SuperLink(tmp_path / "b", "127.0.0.1", 1, tls=gone).start()
    assert not (tmp_path / "a").exists() and not (tmp_path / "b").exists()


# ---------------------------------------------------------------- the `flwr` CLI's connection


def test_flwr_run_trusts_the_fleet_ca_or_is_explicitly_insecure(tmp_path: Path) -> None:
    odd = tmp_path / 'a "quoted" dir\\ca.crt'
    tls = tomllib.loads(connection_toml("fedge-fleet", "10.0.0.5:9092", odd))
    assert tls["superlink"]["default"] == "fedge-fleet"
    assert tls["superlink"]["fedge-fleet"] == {
        "address": "10.0.0.5:9092",
        "root-certificates": str(odd),
    }
    plain = tomllib.loads(connection_toml("fedge-fleet", "127.0.0.1:9092", None))
    assert plain["superlink"]["fedge-fleet"]["insecure"] is True
    with pytest.raises(ValueError, match="connection name"):
        connection_toml("a.b]", "x:1", None)

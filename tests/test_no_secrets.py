"""Nothing under the repo or in any log holds a private key, a password or a token
(issue 13).

(a) Every file git tracks or would track (not ignored) is scanned for PEM private key
    blocks, credentials that look generated, literal passwords outside test fixtures,
    enrollment and console tokens, and key or password files.
(b) A real fleet runs -- `manager up` (broker and serve), `edge enroll` and
    `agent enroll` with a one-time token over HTTPS, `agent run` until the station
    reports -- with the CA key encrypted by FEDGE_CA_PASSPHRASE; then every log it wrote
    is searched for any PEM private key, the body of every key file, the token and the
    passphrase. `edge enroll` prints the token for the person on purpose: its stdout is
    the one output not searched for it.

Failures name the file and line and the kind of secret, never the secret.
"""

import re
import secrets
import subprocess
from collections.abc import Iterator
from pathlib import Path

import pytest
from conftest import FleetHome, Processes, make_fleet_home, wait_until

from fedge.edge_manager.security.enrollment import invite
from fedge.edge_manager.security.pki import PASSPHRASE_ENV
from fedge.protocols import pki
from fedge.protocols.fleet_ca import FleetCA

REPO = Path(__file__).resolve().parents[1]
EDGE = "st-01"

PEM_KEY_MARK = b"PRIVATE KEY-----"
# A whole block, also when written into source as a string with "\n" escapes; a lone
# header line (a test checking what a file starts with) is no key.
PEM_KEY_BLOCK = re.compile(
    rb"-----BEGIN [A-Z0-9 ]*PRIVATE KEY-----[A-Za-z0-9+/=\s\\:,.\"'-]{40,}?"
    rb"-----END [A-Z0-9 ]*PRIVATE KEY-----"
)
# key = "value" / key: "value" / "key": "value" / key="value" (f-strings are skipped:
# their value comes from elsewhere).
CREDENTIAL = re.compile(
    rb"""(?i)\b(password|passphrase|token|secret)["']?\s*[=:]\s*b?(["'])([^"'{}\n]*)\2"""
)
ENROLL_TOKEN = re.compile(rb"\b[A-Za-z0-9_-]{16,64}\.[0-9a-f]{64}\b")  # <secret>.<CA pin>
CONSOLE_TOKEN = re.compile(rb"\bfct_[A-Za-z0-9_-]{32,}")
SECRET_FILE = re.compile(r"(\.key|\.pem|\.p12|\.pfx|\.password|/passwd|^passwd)$")
PLACEHOLDERS = {b"...", b"unused"}
NL = b"\n"


def looks_generated(value: bytes) -> bool:
    """What secrets.token_urlsafe / token_hex make (16+ characters, many of them
    distinct), not a fixture like "pw" or a golden-bytes "AAAA...A"."""
    return (
        len(value) >= 16
        and re.fullmatch(rb"[A-Za-z0-9_-]+", value) is not None
        and len(set(value)) >= 10
    )


def secrets_in(path: str, data: bytes) -> list[str]:
    """Where ``data`` (the file ``path`` of the repo) holds a secret: "path:line kind"."""
    found: list[str] = []

    def at(offset: int, kind: str) -> None:
        found.append(f"{path}:{data.count(NL, 0, offset) + 1} {kind}")

    for match in PEM_KEY_BLOCK.finditer(data):
        at(match.start(), "PEM private key")
    for match in ENROLL_TOKEN.finditer(data):
        at(match.start(), "enrollment token")
    for match in CONSOLE_TOKEN.finditer(data):
        at(match.start(), "console token")
    in_tests = path.startswith("tests/")
    for match in CREDENTIAL.finditer(data):
        name, value = match.group(1).lower(), match.group(3)
        if looks_generated(value):
            at(match.start(), f"a generated-looking {name.decode()}")
        elif (
            name == b"password"
            and not in_tests  # short literals there are fixtures ("pw", "secret")
            and value
            and value not in PLACEHOLDERS
            and not (value.startswith(b"<") and value.endswith(b">"))
        ):
            at(match.start(), "a literal password")
    if SECRET_FILE.search(path):
        found.append(f"{path} a key or password file")
    return found


def repo_files() -> list[str]:
    listed = subprocess.run(
        ["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
        cwd=REPO,
        capture_output=True,
        check=True,
    ).stdout
    return sorted({name.decode() for name in listed.split(b"\0") if name})


# ---------------------------------------------------------------- (a) the repo


@pytest.mark.integration
def test_no_file_in_the_repo_holds_a_private_key_a_password_or_a_token() -> None:
    files = repo_files()
    assert "src/fedge/protocols/pki.py" in files and len(files) > 100
    found = [
        hit
        for name in files
        if (REPO / name).is_file()  # tracked but deleted in this working tree
        for hit in secrets_in(name, (REPO / name).read_bytes())
    ]
    assert found == [], "secrets in the repo:\n" + "\n".join(found)


def test_the_scan_finds_planted_keys_passwords_and_tokens(tmp_path: Path) -> None:
    """The repo scan is only worth something if it catches real secrets: planted ones."""
    fh = make_fleet_home(tmp_path, edges=())
    try:
        token = str(invite(fh.home, EDGE).token)
    finally:
        fh.close()
    _cert, key = FleetCA.create("plant-a").issue_client("alice", pki.Role.OPERATOR)
    generated = secrets.token_urlsafe(18).encode()
    escaped = repr(key.decode()).encode()  # a key pasted into source as one string
    planted = {
        "src/fedge/a.py": b'KEY = """' + key + b'"""\n',
        "src/fedge/b.py": b"KEY = " + escaped + b"\n",
        "tests/c.py": b'edge_token = "' + token.encode() + b'"\n',
        "README.md": b"fedge console token add: fct_" + generated + generated + b"\n",
        "tests/d.py": b'{"password": "' + generated + b'"}\n',
        "src/fedge/e.py": b'password = "hunter2"\n',
        "tests/ca.key": b"",
    }
    kinds = {path: [hit.partition(" ")[2] for hit in secrets_in(path, data)]
             for path, data in planted.items()}  # fmt: skip
    assert kinds == {
        "src/fedge/a.py": ["PEM private key"],
        "src/fedge/b.py": ["PEM private key"],
        "tests/c.py": ["enrollment token"],
        "README.md": ["console token"],
        "tests/d.py": ["a generated-looking password"],
        "src/fedge/e.py": ["a literal password"],
        "tests/ca.key": ["a key or password file"],
    }
    # Fixtures and placeholders pass; a header line alone is no key.
    assert secrets_in("tests/f.py", b'password="pw"\ntoken: "AAAAAAAAAAAAAAAAAAAAAAAA"\n') == []
    assert secrets_in("src/fedge/g.py", b'password="unused"  # insecure = true, "..."\n') == []
    assert secrets_in("tests/h.py", b'startswith(b"-----BEGIN PRIVATE KEY-----")\n') == []


# ---------------------------------------------------------------- (b) the logs of a fleet


def key_bodies(paths: list[Path]) -> dict[str, list[bytes]]:
    """Each key file's base64 body: whole, and every full line alone."""
    bodies: dict[str, list[bytes]] = {}
    for path in paths:
        lines = [ln.strip() for ln in path.read_bytes().splitlines()]
        body = [ln for ln in lines if ln and not ln.startswith(b"-----") and b":" not in ln]
        assert body, f"{path} holds no PEM body"
        bodies[str(path)] = [b"".join(body), *(ln for ln in body if len(ln) >= 32)]
    return bodies


def log_files(root: Path) -> list[Path]:
    """Everything the run logged: <home>/logs, mosquitto's log, the agent's log file
    (and rotations), the captured stdout/stderr of every process."""
    names = re.compile(r"\.(log|out|err|stderr)(\.\d+)?$")
    return sorted(p for p in root.rglob("*") if p.is_file() and names.search(p.name))


@pytest.fixture
def passphrase(monkeypatch: pytest.MonkeyPatch, processes: Processes) -> Iterator[str]:
    value = secrets.token_urlsafe(20)
    monkeypatch.setenv(PASSPHRASE_ENV, value)  # for the home made in this process
    processes.env[PASSPHRASE_ENV] = value  # for `manager up` and what it starts
    yield value


@pytest.mark.integration
def test_a_running_fleet_logs_no_key_token_or_passphrase(
    tmp_path: Path, processes: Processes, passphrase: str
) -> None:
    fh: FleetHome = make_fleet_home(tmp_path, edges=())
    root = fh.home.root
    assert (root / "pki" / "ca.key").read_bytes().startswith(b"-----BEGIN ENCRYPTED PRIVATE KEY")
    processes.env["FEDGE_HOME"] = str(root)
    processes.pidfiles.append(root / "broker" / "mosquitto.pid")
    device = tmp_path / "device"
    outputs: list[tuple[str, str]] = []  # (what, text) of the commands run to completion

    def cli(*args: str) -> str:
        result = processes.cli(*args, timeout_s=60)
        outputs.append((f"fedge {args[0]} {args[1]} stderr", result.stderr))
        return result.stdout

    try:
        # serve opens the encrypted CA key to sign the station's CSR.
        outputs.append(("fedge manager up stdout", cli("manager", "up")))
        invitation = cli("edge", "enroll", EDGE)
        command = re.search(r"^(fedge agent enroll .*) --config \S+$", invitation, re.M)
        found = re.search(r"^token: (\S+)$", invitation, re.M)
        assert command is not None and found is not None, invitation
        token = found.group(1)
        enrolled = cli(
            *command.group(1).split()[1:],
            "--token", token,
            "--config", str(device / "agent.toml"),
            "--data-dir", str(device / "data"),
        )  # fmt: skip
        outputs.append(("fedge agent enroll stdout", enrolled))
        agent_log = device / "logs" / "agent.log"
        processes.start(
            "agent", "agent", "run", "--config", str(device / "agent.toml"),
            "--log-file", str(agent_log), "-v",
        )  # fmt: skip
        wait_until(lambda: fh.edge_row(EDGE).get("state"), 30, "the station online",
                   expect=lambda state: state == "online")  # fmt: skip
        wait_until(lambda: "connected" in agent_log.read_text(), 10, "the agent's log")
        doctor = processes.cli("manager", "doctor", timeout_s=60)
        outputs.append(("fedge manager doctor", doctor.stdout + doctor.stderr))
        assert "0 error(s), 0 warning(s)" in doctor.stdout  # the CA key is encrypted
    except BaseException:
        for proc in processes.procs:
            print(proc.output()[-3000:])
        raise
    finally:
        outputs.append(("fedge manager down stdout", cli("manager", "down")))
        fh.close()

    keys = sorted(root.rglob("*.key")) + sorted(device.rglob("*.key"))
    assert root / "pki" / "ca.key" in keys and device / "agent.key" in keys
    needles = {f"the body of {path}": body for path, body in key_bodies(keys).items()}
    needles["a PEM private key"] = [PEM_KEY_MARK]
    needles["the enrollment token"] = [token.encode(), token.partition(".")[0].encode()]
    needles[PASSPHRASE_ENV] = [passphrase.encode()]

    logs = log_files(tmp_path)
    assert root / "logs" / "serve.log" in logs and agent_log in logs
    assert root / "broker" / "mosquitto.log" in logs
    assert "enrolled st-01" in (root / "logs" / "serve.log").read_text()  # it did log
    texts = [(str(p), p.read_bytes()) for p in logs]
    texts += [(what, text.encode()) for what, text in outputs]
    leaks = [
        f"{what} in {where}"
        for where, data in texts
        for what, patterns in needles.items()
        if any(pattern in data for pattern in patterns)
    ]
    assert leaks == [], "secrets in logs:\n" + "\n".join(leaks)

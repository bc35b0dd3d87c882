"""Console accounts: manager-issued operator tokens, each with a role.

Until the operator identities of the security issue land, a person logs in to the console
with a token the manager issued (``fedge console token add NAME --role ROLE``). Only the
token's SHA-256 is stored, in the manager's own store (table ``console_tokens``): a
token is 32 random bytes, so a plain hash is as good as a slow one, and a copy of the
store reveals no token. The token is shown once, when it is made.
"""

import hashlib
import secrets
import time
from dataclasses import dataclass
from enum import StrEnum

from fedge.console.errors import ConsoleError
from fedge.edge_manager.store import Store
from fedge.protocols import validate
from fedge.protocols.errors import ProtocolError

# The console's own tables live beside the fleet's, in the manager's store: one source of
# truth, backed up and pruned with it. Created on first use (store.py stays the fleet's).
SCHEMA = """
CREATE TABLE IF NOT EXISTS console_tokens (
    name TEXT PRIMARY KEY, role TEXT NOT NULL, token_sha256 TEXT NOT NULL UNIQUE,
    created_at REAL NOT NULL);
CREATE TABLE IF NOT EXISTS console_audit (
    at REAL NOT NULL, who TEXT NOT NULL, role TEXT NOT NULL, action TEXT NOT NULL,
    target TEXT NOT NULL, detail TEXT NOT NULL, outcome TEXT NOT NULL);
CREATE INDEX IF NOT EXISTS console_audit_at ON console_audit (at);
"""

TOKEN_PREFIX = "fct_"  # "fedge console token": recognisable if pasted in the wrong place


class Role(StrEnum):
    VIEWER = "viewer"  # sees every page, changes nothing
    OPERATOR = "operator"  # also sets thresholds and labels predictions
    ADMIN = "admin"  # also reads the audit log

    @property
    def can_act(self) -> bool:
        return self is not Role.VIEWER


@dataclass(frozen=True)
class Account:
    name: str
    role: Role
    created_at: float


def ensure_tables(store: Store) -> None:
    store.conn.executescript(SCHEMA)


def digest(token: str) -> str:
    return hashlib.sha256(token.encode()).hexdigest()


def parse_role(value: str) -> Role:
    try:
        return Role(value)
    except ValueError:
        choices = ", ".join(role.value for role in Role)
        raise ConsoleError(f"role must be one of {choices}, not {value!r}") from None


def add_token(store: Store, name: str, role: Role) -> str:
    """A new token for ``name`` (replacing any it had); returns the token, shown once."""
    try:
        validate.identifier(name, "account name")
    except ProtocolError as exc:
        raise ConsoleError(str(exc)) from None
    ensure_tables(store)
    token = TOKEN_PREFIX + secrets.token_urlsafe(32)
    store.conn.execute(
        "INSERT INTO console_tokens (name, role, token_sha256, created_at) VALUES (?,?,?,?) "
        "ON CONFLICT (name) DO UPDATE SET role=excluded.role, "
        "token_sha256=excluded.token_sha256, created_at=excluded.created_at",
        (name, role.value, digest(token), time.time()),
    )
    return token


def remove_token(store: Store, name: str) -> None:
    ensure_tables(store)
    if store.conn.execute("DELETE FROM console_tokens WHERE name=?", (name,)).rowcount == 0:
        raise ConsoleError(f"no console account {name!r}; see `fedge console token list`")


def list_accounts(store: Store) -> list[Account]:
    ensure_tables(store)
    rows = store.query("SELECT name, role, created_at FROM console_tokens ORDER BY name")
    return [Account(str(r["name"]), Role(r["role"]), float(r["created_at"])) for r in rows]


def account(store: Store, name: str) -> Account | None:
    """The account ``name`` as it is now (a removed token ends its sessions at once)."""
    row = store.one("SELECT name, role, created_at FROM console_tokens WHERE name=?", (name,))
    return None if row is None else Account(str(row["name"]), Role(row["role"]), row["created_at"])


def authenticate(store: Store, token: str) -> Account | None:
    """The account whose token this is, or None. Compared as hashes, in constant time."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 256:
        return None
    wanted = digest(token)
    found = None
    for row in store.query("SELECT name, role, created_at, token_sha256 FROM console_tokens"):
        if secrets.compare_digest(str(row["token_sha256"]), wanted):
            found = Account(str(row["name"]), Role(row["role"]), float(row["created_at"]))
    return found

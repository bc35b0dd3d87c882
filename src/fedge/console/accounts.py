"""Console accounts: manager-issued operator tokens, each with a role.

Until the operator identities of the security issue land, a person logs in to the console
with a token the manager issued (``fedge console token add NAME --role ROLE``). Only the
token's SHA-256 is stored, in the manager's own store (table ``console_tokens``, through
console_store.py): a token is 32 random bytes, so a plain hash is as good as a slow one,
and a copy of the store reveals no token. The token is shown once, when it is made.
"""

import hashlib
import secrets
import time
from dataclasses import dataclass
from enum import StrEnum

from fedge.console import console_store
from fedge.console.errors import ConsoleError
from fedge.edge_manager.store import Store
from fedge.protocols import validate
from fedge.protocols.errors import ProtocolError

TOKEN_PREFIX = "fct_"  # "fedge console token": recognisable if pasted in the wrong place


class Role(StrEnum):
    VIEWER = "viewer"  # sees every page, changes nothing
    OPERATOR = "operator"  # also sets thresholds and labels predictions
    ADMIN = "admin"  # also reads the audit log and decides what images leave a station

    @property
    def can_act(self) -> bool:
        return self is not Role.VIEWER

    @property
    def can_share_images(self) -> bool:
        """Whether a station's images may be shared (a privacy decision, not a tuning one)."""
        return self is Role.ADMIN


@dataclass(frozen=True)
class Account:
    name: str
    role: Role
    created_at: float


def ensure_tables(store: Store) -> None:
    """Create the console's tables (tokens, audit log) if the store has none yet."""
    console_store.ensure_tables(store)


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
    console_store.put_token(store, name, role.value, digest(token), time.time())
    return token


def remove_token(store: Store, name: str) -> None:
    ensure_tables(store)
    if not console_store.delete_token(store, name):
        raise ConsoleError(f"no console account {name!r}; see `fedge console token list`")


def list_accounts(store: Store) -> list[Account]:
    ensure_tables(store)
    return [Account(r.name, Role(r.role), r.created_at) for r in console_store.tokens(store)]


def account(store: Store, name: str) -> Account | None:
    """The account ``name`` as it is now (a removed token ends its sessions at once)."""
    row = console_store.token(store, name)
    return None if row is None else Account(row.name, Role(row.role), row.created_at)


def authenticate(store: Store, token: str) -> Account | None:
    """The account whose token this is, or None. Compared as hashes, in constant time."""
    if not token.startswith(TOKEN_PREFIX) or len(token) > 256:
        return None
    wanted = digest(token)
    found = None
    for row in console_store.token_digests(store):
        if secrets.compare_digest(row.token_sha256, wanted):
            found = Account(row.name, Role(row.role), row.created_at)
    return found

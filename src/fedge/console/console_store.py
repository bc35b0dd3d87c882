"""The console's own tables in the manager's store: operator tokens, the audit log and
operators' acknowledgements of alerts.

:mod:`fedge.console.accounts` issues, checks and lists tokens and :mod:`fedge.console.audit`
writes and reads the audit log through these; the roles, hashing and truncation stay
there. Only a token's SHA-256 is ever stored.
"""

from dataclasses import dataclass

from fedge.edge_manager.store import Store

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
-- An operator's acknowledgement of an alert (issue 30, item 6): "seen, someone is on it",
-- with a note. Separate from clearing: the alert stays open and its condition watched.
CREATE TABLE IF NOT EXISTS console_alert_acks (
    alert_id TEXT PRIMARY KEY, who TEXT NOT NULL, note TEXT NOT NULL, at REAL NOT NULL);
"""


@dataclass(frozen=True)
class TokenRow:
    """A console account as stored: its role by name (accounts.Role checks it)."""

    name: str
    role: str
    created_at: float


@dataclass(frozen=True)
class TokenDigest:
    """A console account with its token's SHA-256, to authenticate against."""

    name: str
    role: str
    created_at: float
    token_sha256: str


@dataclass(frozen=True)
class AuditRow:
    """One audit log row as stored: its outcome by name (audit.Outcome checks it)."""

    at: float
    who: str
    role: str
    action: str
    target: str
    detail: str
    outcome: str


def ensure_tables(store: Store) -> None:
    store.conn.executescript(SCHEMA)


def put_token(store: Store, name: str, role: str, token_sha256: str, created_at: float) -> None:
    """Store ``name``'s token, replacing any it had (its role and time with it)."""
    store.conn.execute(
        "INSERT INTO console_tokens (name, role, token_sha256, created_at) VALUES (?,?,?,?) "
        "ON CONFLICT (name) DO UPDATE SET role=excluded.role, "
        "token_sha256=excluded.token_sha256, created_at=excluded.created_at",
        (name, role, token_sha256, created_at),
    )


def delete_token(store: Store, name: str) -> bool:
    """Remove ``name``'s token; False when it had none."""
    return store.conn.execute("DELETE FROM console_tokens WHERE name=?", (name,)).rowcount > 0


def tokens(store: Store) -> list[TokenRow]:
    """Every console account, by name."""
    rows = store.query("SELECT name, role, created_at FROM console_tokens ORDER BY name")
    return [TokenRow(str(r["name"]), str(r["role"]), float(r["created_at"])) for r in rows]


def token(store: Store, name: str) -> TokenRow | None:
    row = store.one("SELECT name, role, created_at FROM console_tokens WHERE name=?", (name,))
    if row is None:
        return None
    return TokenRow(str(row["name"]), str(row["role"]), float(row["created_at"]))


def token_digests(store: Store) -> list[TokenDigest]:
    """Every console account with its token's SHA-256, in no particular order."""
    return [
        TokenDigest(str(r["name"]), str(r["role"]), float(r["created_at"]), str(r["token_sha256"]))
        for r in store.query("SELECT name, role, created_at, token_sha256 FROM console_tokens")
    ]


def add_audit(store: Store, row: AuditRow) -> None:
    store.conn.execute(
        "INSERT INTO console_audit (at, who, role, action, target, detail, outcome) "
        "VALUES (?,?,?,?,?,?,?)",
        (row.at, row.who, row.role, row.action, row.target, row.detail, row.outcome),
    )


def recent_audit(store: Store, limit: int) -> list[AuditRow]:
    """The newest ``limit`` audit rows, newest first (ties: the later written first)."""
    rows = store.query(
        "SELECT at, who, role, action, target, detail, outcome FROM console_audit "
        "ORDER BY at DESC, rowid DESC LIMIT ?",
        (limit,),
    )
    return [
        AuditRow(
            float(r["at"]),
            str(r["who"]),
            str(r["role"]),
            str(r["action"]),
            str(r["target"]),
            str(r["detail"]),
            str(r["outcome"]),
        )
        for r in rows
    ]


@dataclass(frozen=True)
class AlertAck:
    alert_id: str
    who: str
    note: str
    at: float


def put_alert_ack(store: Store, ack: AlertAck) -> None:
    """Record (or renew: the newest acknowledgement is the one shown) an acknowledgement."""
    store.conn.execute(
        "INSERT OR REPLACE INTO console_alert_acks (alert_id, who, note, at) VALUES (?,?,?,?)",
        (ack.alert_id, ack.who, ack.note, ack.at),
    )


def alert_acks(store: Store, alert_ids: list[str]) -> dict[str, AlertAck]:
    """The acknowledgements of ``alert_ids`` (those without one are left out)."""
    found: dict[str, AlertAck] = {}
    for start in range(0, len(alert_ids), 500):  # under SQLite's bound-parameter limit
        chunk = alert_ids[start : start + 500]
        marks = ",".join("?" * len(chunk))
        for r in store.query(
            f"SELECT alert_id, who, note, at FROM console_alert_acks WHERE alert_id IN ({marks})",
            tuple(chunk),
        ):
            found[str(r["alert_id"])] = AlertAck(
                str(r["alert_id"]), str(r["who"]), str(r["note"]), float(r["at"])
            )
    return found

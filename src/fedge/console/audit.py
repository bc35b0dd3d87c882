"""The console's audit log: every action an operator attempted, who, when and how it ended.

Refused attempts (a viewer acting, a missing CSRF token, bad input) are written too: an
audit log that only lists successes hides exactly what it is for. Tokens and form values
other than the ones that name the change are never written.
"""

import time
from dataclasses import dataclass
from enum import StrEnum

from fedge.console import console_store
from fedge.console.accounts import ensure_tables
from fedge.edge_manager.store import Store


class Outcome(StrEnum):
    DONE = "done"
    REFUSED = "refused"  # not allowed: role, CSRF, login failure
    INVALID = "invalid"  # allowed, but the input was wrong; nothing changed
    FAILED = "failed"  # allowed and well formed, but the far side did not deliver (a station)


@dataclass(frozen=True)
class AuditEntry:
    at: float
    who: str
    role: str
    action: str
    target: str
    detail: str
    outcome: Outcome


def record(store: Store, entry: AuditEntry) -> None:
    console_store.add_audit(
        store,
        console_store.AuditRow(
            entry.at,
            entry.who[:128],
            entry.role,
            entry.action,
            entry.target[:256],
            entry.detail[:512],
            entry.outcome.value,
        ),
    )


def entry(
    who: str, role: str, action: str, target: str, detail: str, outcome: Outcome
) -> AuditEntry:
    return AuditEntry(time.time(), who, role, action, target, detail, outcome)


def recent(store: Store, limit: int = 200) -> list[AuditEntry]:
    ensure_tables(store)
    return [
        AuditEntry(r.at, r.who, r.role, r.action, r.target, r.detail, Outcome(r.outcome))
        for r in console_store.recent_audit(store, limit)
    ]

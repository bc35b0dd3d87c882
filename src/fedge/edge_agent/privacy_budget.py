"""The station's lifetime privacy budget: from its signed config into its privacy ledger.

An operator sets the bound with ``fedge edge set-privacy`` (a new signed config version);
the agent writes it into the ledger in its data directory (``privacy.db``,
:mod:`fedge.party.privacy_status`), where the station's ClientApp checks every DP-SGD
round against it before training (budgets are enforced where the data is, issue 12).
The ledger outlives agent restarts and model reinstalls, and so does the bound in it.

The agent writes the ledger *before* it persists the config as applied: a crash between
the two leaves the config unapplied, and the retained copy, offered again, rewrites the
same bound. A ledger that cannot be written rejects the config (the operator sees why in
``fedge edge show``): a station must not report a budget it cannot enforce.

:mod:`fedge.party.budget` needs only the standard library (Opacus is imported when a
budget is computed, in the ClientApp): an inference-only station can hold a bound, and one
without a budget never opens a ledger. A local rollback, which
puts the previous model's config back, leaves the ledger alone: the bound is the
station's, not a model's, and only a newer signed version changes it.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from fedge.edge_agent.decisions import ConfigAction, ConfigDecision
from fedge.edge_agent.errors import AgentError
from fedge.party.budget import BudgetLedger
from fedge.party.privacy_status import ledger_path
from fedge.privacy.settings import PrivacyError
from fedge.protocols.config import EdgeConfig, PrivacyBudget

Lifetime = tuple[float | None, float]


class BudgetLedgerError(AgentError):
    """The station's privacy ledger could not take the configured bound."""


def lifetime_change(current: Lifetime, budget: PrivacyBudget | None) -> Lifetime | None:
    """The ledger's new ``(epsilon, delta)`` for ``budget``, or None when it holds it already.

    No budget clears the epsilon bound and keeps the ledger's delta (a delta alone bounds
    nothing; the ledger needs one to account at).
    """
    wanted: Lifetime = (None, current[1]) if budget is None else (budget.epsilon, budget.delta)
    return None if wanted == current else wanted


def apply_budget(data_dir: Path, budget: PrivacyBudget | None) -> Lifetime | None:
    """Write ``budget`` into the station's ledger; the lifetime written (None: unchanged)."""
    path = ledger_path(data_dir)
    if budget is None and not path.exists():
        return None  # never bounded: no ledger to create for an inference-only station
    try:
        ledger = BudgetLedger(path)
        try:
            change = lifetime_change(ledger.lifetime(), budget)
            if change is not None:
                ledger.set_lifetime(*change)
            return change
        finally:
            ledger.close()
    except (PrivacyError, OSError, sqlite3.Error) as exc:
        raise BudgetLedgerError(
            f"the privacy budget could not be written to {path}: {exc}; free the disk or "
            "fix the file's permissions, and the config applies when it is offered again"
        ) from exc


def admit_budget(data_dir: Path, offered: EdgeConfig) -> ConfigDecision:
    """APPLY once ``offered``'s budget is in the ledger; REJECT, saying why, if it cannot be."""
    try:
        apply_budget(data_dir, offered.privacy)
    except BudgetLedgerError as exc:
        return ConfigDecision(ConfigAction.REJECT, str(exc))
    return ConfigDecision(ConfigAction.APPLY)

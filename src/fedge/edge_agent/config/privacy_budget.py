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

The station's own privacy floor (:mod:`fedge.privacy.floor`) comes from agent.toml, never
from a signed config: :func:`write_floor` copies it into the ledger at every agent start
(and ``fedge agent privacy-floor`` when the station's operator changes it). The ledger
bounds rounds by the smaller of the floor and the signed budget, so a signed budget can
only tighten the floor, and clearing it leaves the floor.
"""

from __future__ import annotations

import sqlite3
from pathlib import Path

from fedge.edge_agent.config.decisions import ConfigAction, ConfigDecision
from fedge.edge_agent.errors import AgentError
from fedge.edge_agent.settings import load_settings
from fedge.party.budget import BudgetLedger
from fedge.party.privacy_status import ledger_path
from fedge.privacy.floor import PrivacyFloor, floor_toml
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


def write_floor(data_dir: Path, floor: PrivacyFloor | None) -> None:
    """Write the station's own floor (None: its operator opted out) into its ledger.

    A ledger that cannot take it stops the agent: a station must not train on a floor it
    cannot enforce."""
    path = ledger_path(data_dir)
    try:
        ledger = BudgetLedger(path)
        try:
            ledger.set_floor(floor)
        finally:
            ledger.close()
    except (PrivacyError, OSError, sqlite3.Error) as exc:
        raise BudgetLedgerError(
            f"the station's privacy floor could not be written to {path}: {exc}; free the "
            "disk or fix the file's permissions, then start the agent again"
        ) from exc


def read_floor(data_dir: Path) -> tuple[bool, PrivacyFloor | None]:
    """(whether a floor record exists, the floor or None) as the ledger holds it."""
    path = ledger_path(data_dir)
    if not path.exists():
        return False, None
    ledger = BudgetLedger(path)
    try:
        return ledger.floor_state()
    finally:
        ledger.close()


def set_local_floor(config: Path, floor: PrivacyFloor | None) -> Path:
    """The station operator's command (``fedge agent privacy-floor``): write ``floor``
    (None: opt out) into agent.toml and into the station's ledger at once; the data
    directory's path. A running agent's ClientApp sees it from its next round; the agent
    writes the same again at its next start."""
    settings = load_settings(config)  # a broken agent.toml is refused before any change
    text = config.read_text(encoding="utf-8")
    lines = text.splitlines()
    if any(line.strip() == "[privacy_floor]" for line in lines):
        raise BudgetLedgerError(
            f"{config} has a [privacy_floor] table: edit it there (or remove it and run "
            "this command again)"
        )
    comments = {ln for ln in (*floor_toml(None), *floor_toml(PrivacyFloor())) if ln[:1] == "#"}
    kept = [ln for ln in lines if not ln.startswith("privacy_floor") and ln not in comments]
    first_table = next((i for i, line in enumerate(kept) if line.startswith("[")), len(kept))
    kept[first_table:first_table] = floor_toml(floor)
    temporary = config.with_suffix(".tmp")
    temporary.write_text("\n".join(kept) + "\n", encoding="utf-8")
    temporary.chmod(config.stat().st_mode & 0o777)
    temporary.replace(config)
    write_floor(settings.data_dir, floor)
    return settings.data_dir

"""Where a station's privacy ledger lives, and the epsilon it spent as its agent reports it.

Stdlib only: the inference-only agent imports this (it never imports torch or Opacus).

The ledger (:mod:`fedge.party.budget`) is the truth: every DP-SGD release the station made,
and its lifetime bound from the signed edge config. It sits in the agent's data directory
(``privacy.db``) beside the kept images, apart from anything a model install replaces, so
it survives agent restarts and reinstalls of the model.

Turning the ledger's releases into an epsilon needs an Opacus accountant, which the agent
must not load. So the station's ClientApp, which has just accounted its round, leaves
the lifetime total in ``privacy-spent.json`` beside the ledger; the agent sends it up as
the telemetry metric ``privacy.epsilon_spent`` and ``fedge edge show`` displays it. The
file is a report, never consulted to decide anything: the ClientApp checks the ledger.
"""

from __future__ import annotations

import json
import math
import os
from dataclasses import dataclass
from pathlib import Path

LEDGER_FILE = "privacy.db"
SPENT_FILE = "privacy-spent.json"
SPENT_METRIC = "privacy.epsilon_spent"
FLOOR_METRIC = "privacy.floor_lifetime_epsilon"
"""The station's own floor as its agent reports it: its lifetime epsilon, 0 when the
station's operator opted out of a floor (``privacy_floor = "none"`` in agent.toml)."""
FLOOR_JOB_METRIC = "privacy.floor_job_epsilon"


def ledger_path(data_dir: Path) -> Path:
    """The station's privacy ledger in the agent's data directory."""
    return data_dir / LEDGER_FILE


@dataclass(frozen=True)
class SpentEpsilon:
    """The station's epsilon over every job, at ``delta``, as of ``at`` (Unix time)."""

    epsilon: float
    delta: float
    at: float


def write_spent(data_dir: Path, spent: SpentEpsilon) -> None:
    """Replace the report atomically (a reader sees the old one or the new one)."""
    path = data_dir / SPENT_FILE
    temporary = path.with_suffix(".tmp")
    body = {"epsilon": spent.epsilon, "delta": spent.delta, "at": spent.at}
    temporary.write_text(json.dumps(body), encoding="utf-8")
    os.replace(temporary, path)


def read_spent(data_dir: Path) -> SpentEpsilon | None:
    """The last report, or None when there is none or it is unreadable (it is only a report)."""
    try:
        body = json.loads((data_dir / SPENT_FILE).read_text(encoding="utf-8"))
        spent = SpentEpsilon(float(body["epsilon"]), float(body["delta"]), float(body["at"]))
    except (OSError, ValueError, KeyError, TypeError):
        return None
    if not all(math.isfinite(v) for v in (spent.epsilon, spent.delta, spent.at)):
        return None
    return spent

"""``fedge manager doctor``'s look at the signing key: rotations and who follows them.

Facts come from key_rotation.trust_view and the ``keys/`` folder (doctor_facts.py); the
check is pure and gives (severity, subject, message) for doctor.py to turn into findings:
- a station that refused a rotation: an error (a forged or foreign chain reached it; if
  it no longer trusts the current key it applies nothing the manager signs);
- a ``keys/next/`` key: a rotation cut short (a warning: the next ``manager serve`` or
  ``rotate-key`` finishes it or drops the unused key);
- stations not yet known to trust the current key: a warning naming them.
"""

from dataclasses import dataclass
from typing import Literal

SIGNING_KEY = "signing-key"
Judgement = tuple[Literal["ok", "warning", "error"], str, str]  # severity, subject, message


@dataclass(frozen=True)
class SigningKeyFact:
    key_id: str
    rotations: int
    cut_short: bool = False
    refused: tuple[tuple[str, str, bool], ...] = ()  # (edge, its reason, trusts current key)
    behind: tuple[str, ...] = ()


def check_signing_key(fact: SigningKeyFact) -> list[Judgement]:
    found: list[Judgement] = []
    for edge, reason, current in fact.refused:
        then = (
            "it still trusts the current key"
            if current
            else "it does not trust the current key and applies nothing it signs: enrol it again"
        )
        found.append(("error", edge, f"refused a key rotation ({reason}); {then}"))
    if fact.cut_short:
        found.append(
            (
                "warning",
                "keys/next",
                "a key rotation was cut short; the next `fedge manager serve` (or "
                "`rotate-key`) finishes it or drops the unused key",
            )
        )
    if fact.behind:
        shown = ", ".join(fact.behind[:10]) + (" …" if len(fact.behind) > 10 else "")
        found.append(
            (
                "warning",
                shown,
                f"{len(fact.behind)} station(s) have not reported the current key "
                f"{fact.key_id} yet (offline since rotation {fact.rotations}?)",
            )
        )
    if not found:
        found.append(
            (
                "ok",
                "home",
                f"signing key {fact.key_id} (rotation {fact.rotations}); no station behind",
            )
        )
    return found

"""``fedge manager doctor``'s look at the fleet CA's key and its revocation list.

Facts come from the home's ``pki/`` folder and the store (doctor_facts.py); the checks
are pure and give (severity, subject, message) for doctor.py to turn into findings:
- ``ca-key-encryption``: the CA key stored without a passphrase (a warning: the file is
  0600, but a copied disk or backup then holds the fleet's root);
- ``crl``: a CRL that does not parse, is not the fleet CA's, has expired, or lacks a
  revocation recorded in the store (errors); one whose next-update is within
  :data:`CRL_WARNING_DAYS` (a warning: `manager serve` issues it again far earlier, so
  it is not running); otherwise the days to its next-update.
"""

import datetime as dt
from collections.abc import Sequence
from dataclasses import dataclass

from fedge.edge_manager.doctor.keys import Judgement

CA_KEY_ENCRYPTION = "ca-key-encryption"
CRL = "crl"
CRL_WARNING_DAYS = 30.0
REISSUE = (
    "`fedge manager serve` issues it again (at start, then hourly, once a third of its "
    "validity is left)"
)


@dataclass(frozen=True)
class RevokedFact:
    serial: int
    identity: str
    revoked_at: dt.datetime


@dataclass(frozen=True)
class CrlFact:
    """The CRL file as read: ``problem`` says why it is unusable (missing, not a CRL, not
    signed by the fleet CA); otherwise the serials it lists and when it expires."""

    path: str
    problem: str = ""
    listed: frozenset[int] = frozenset()
    next_update: dt.datetime | None = None


def check_ca_key(encrypted: bool | None) -> list[Judgement]:
    if encrypted is None:
        return []
    if encrypted:
        return [("ok", "home", "the CA key is encrypted with a passphrase")]
    return [
        (
            "warning",
            "pki/ca.key",
            "the CA key is stored unencrypted (0600); set FEDGE_CA_PASSPHRASE before "
            "`fedge manager init` so a copied disk or backup does not hold the fleet's root",
        )
    ]


def check_crl(
    crl: CrlFact | None, revoked: Sequence[RevokedFact], now: dt.datetime
) -> list[Judgement]:
    """The CRL must list every revocation in the store. Compared by serial, not by date:
    the CRL's lastUpdate is set a few minutes back for clock skew, so a fresh CRL can
    look older than the revocation it carries."""
    if crl is None:
        return []
    if crl.problem:
        return [
            (
                "error",
                crl.path,
                f"{crl.problem}: revoked stations may be let in; `fedge edge revoke ID` "
                "rewrites it",
            )
        ]
    findings: list[Judgement] = []
    missing = sorted((r for r in revoked if r.serial not in crl.listed), key=lambda r: r.revoked_at)
    if missing:
        newest = missing[-1]
        revoked_at = f"{newest.revoked_at:%Y-%m-%d %H:%M} UTC"
        findings.append(
            (
                "error",
                crl.path,
                f"older than the newest revocation: {len(missing)} revoked certificate(s) "
                f"not listed (newest: {newest.identity}, revoked {revoked_at}), so the "
                f"broker still admits them; run `fedge edge revoke {newest.identity}` "
                "again to rewrite it",
            )
        )
    days = None if crl.next_update is None else (crl.next_update - now).total_seconds() / 86400
    if crl.next_update is not None and days is not None and days <= 0:
        findings.append(
            (
                "error",
                crl.path,
                f"expired {crl.next_update:%Y-%m-%d}: the broker refuses every station; "
                f"{REISSUE}: is it running?",
            )
        )
    elif crl.next_update is not None and days is not None and days <= CRL_WARNING_DAYS:
        findings.append(
            (
                "warning",
                crl.path,
                f"next update in {days:.0f} day(s) ({crl.next_update:%Y-%m-%d}), then the "
                f"broker refuses every station; {REISSUE}: is it running?",
            )
        )
    if not findings:
        until = "" if crl.next_update is None else f", until {crl.next_update:%Y-%m-%d}"
        left = "" if days is None else f"; next update in {days:.0f} day(s){until}"
        findings.append(
            (
                "ok",
                crl.path,
                f"the CRL is the fleet CA's and lists every revoked certificate "
                f"({len(revoked)}){left}",
            )
        )
    return findings

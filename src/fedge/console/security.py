"""The console's security page (admins): the fleet's signing key and how far its
rotations have reached, and what ``fedge manager doctor`` finds in the manager home."""

import time
from dataclasses import dataclass

from fedge.edge_manager.doctor.facts import gather
from fedge.edge_manager.doctor.report import Finding, counts, diagnose
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security.key_rotation import TrustView, trust_view
from fedge.protocols.pki import CertificateError


@dataclass(frozen=True)
class SecurityPage:
    trust: TrustView
    key_age_days: float
    behind: tuple[str, ...]  # stations not (yet) known to trust the key in use
    findings: tuple[Finding, ...]  # errors first, as the doctor orders them
    errors: int
    warnings: int


def security_page(home: ManagerHome, now: float | None = None) -> SecurityPage:
    """Read-only: the same views as ``fedge manager keys`` and ``fedge manager doctor``.
    Raises ManagerError when the home cannot be read (an unreadable file, a damaged
    certificate), with what could not be."""
    view = trust_view(home)
    try:
        findings = diagnose(gather(home))
    except (OSError, CertificateError) as exc:
        raise ManagerError(f"the doctor could not read the manager home: {exc}") from None
    tally = counts(findings)
    at = time.time() if now is None else now
    return SecurityPage(
        trust=view,
        key_age_days=(at - view.since) / 86400.0,
        behind=tuple(view.behind()),
        findings=tuple(findings),
        errors=tally["error"],
        warnings=tally["warning"],
    )

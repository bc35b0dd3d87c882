"""Renewing the station's certificate before it expires, without downtime (issue 13).

Station certificates are short-lived (90 days, `pki.CLIENT_DAYS`) so a stolen one is not
good for long. Once a third of its life is left (:func:`renewal_due`) the agent makes a
new key, sends a CSR to the manager's enrollment endpoint over TLS authenticated by the
current certificate, and swaps the files. The current MQTT connection carries on with
the old certificate (still valid); the next connection presents the new one
(``MqttSession.reload_certificate``). A renewal that fails is retried at the next check.

The swap survives a crash: the new pair is written as ``*.next`` files first, then moved
over the key and then the certificate; :func:`complete_pending` finishes an interrupted
swap at start-up, so the key and certificate on disk always belong together.
"""

import datetime as dt
import json
import logging
import os
import ssl
import threading
import urllib.error
import urllib.request
from collections.abc import Callable
from pathlib import Path

from fedge.edge_agent.errors import AgentError
from fedge.edge_agent.identity.crl import refresh_crl
from fedge.edge_agent.identity.enroll import EnrollmentRefused, exchange, refusal
from fedge.edge_agent.settings import AgentSettings
from fedge.protocols import pki
from fedge.protocols.enrollment import RenewRequest
from fedge.protocols.pki import CertInfo, TlsFiles

log = logging.getLogger(__name__)
RENEW_WHEN_LEFT = 1 / 3  # of the certificate's lifetime
# Each check also fetches the fleet's CRL (crl.py), so a revocation reaches the station's
# own endpoints within this; one small HTTPS request per station per check.
CHECK_EVERY_S = 300.0
TIMEOUT_S = 15.0


class RenewalError(AgentError):
    pass


def renewal_due(info: CertInfo, now: dt.datetime, when_left: float = RENEW_WHEN_LEFT) -> bool:
    """Pure: is less than ``when_left`` of the certificate's validity left at ``now``?"""
    life = (info.not_after - info.not_before).total_seconds()
    return (info.not_after - now).total_seconds() < when_left * life


def _next(path: Path) -> Path:
    return path.with_name(path.name + ".next")


def complete_pending(tls: TlsFiles) -> bool:
    """Finish a swap a crash interrupted; True if there was one."""
    key_next, cert_next = _next(tls.key), _next(tls.cert)
    if key_next.exists() and cert_next.exists():
        os.replace(key_next, tls.key)
    if cert_next.exists() and not key_next.exists():
        os.replace(cert_next, tls.cert)
        return True
    return False


def current(tls: TlsFiles) -> CertInfo:
    return pki.cert_info(pki.load_certificate(tls.cert.read_bytes()))


def renew_certificate(url: str, tls: TlsFiles) -> CertInfo:
    """Renew now: a new key and certificate replace the files in ``tls``."""
    identity = current(tls).identity
    key_pem, csr_pem = pki.new_key_and_csr(identity)
    context = ssl.create_default_context(cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    try:
        response = exchange(
            f"{url.rstrip('/')}/v1/renew", RenewRequest(csr_pem.decode()), context, "renewal"
        )
        issued = pki.load_certificate(response.certificate.encode())
    except (EnrollmentRefused, pki.CertificateError) as exc:
        raise RenewalError(str(exc)) from None
    info = pki.cert_info(issued)
    if info.identity != identity or issued.public_key() != pki.load_key(key_pem).public_key():
        raise RenewalError("the renewed certificate is not for this station's new key")
    pki.write_private(_next(tls.key), key_pem)
    partial = tls.cert.with_name(tls.cert.name + ".partial")
    partial.write_text(response.certificate)
    os.replace(partial, _next(tls.cert))  # a *.next certificate is always whole
    complete_pending(tls)
    return info


def confirm_certificate(url: str, tls: TlsFiles) -> int:
    """Tell the manager this station holds its newest certificate (presented over TLS):
    its older ones are revoked at once. The number revoked; RenewalError if refused."""
    context = ssl.create_default_context(cafile=str(tls.ca))
    context.load_cert_chain(str(tls.cert), str(tls.key))
    request = urllib.request.Request(f"{url.rstrip('/')}/v1/confirm", data=b"", method="POST")
    try:
        with urllib.request.urlopen(request, context=context, timeout=30) as reply:
            answer = json.loads(reply.read(4096))
    except urllib.error.HTTPError as exc:
        detail = refusal(exc)
        raise RenewalError(f"confirming the certificate refused ({exc.code}): {detail}") from None
    except (urllib.error.URLError, OSError, ValueError) as exc:
        raise RenewalError(f"confirming the certificate at {url} failed: {exc}") from None
    return int(answer.get("revoked", 0))


class CertificateRenewer:
    """Checks every ``check_every_s`` and renews when due; ``on_renewed`` is told after a
    swap (the agent reloads its MQTT session's certificate there)."""

    def __init__(
        self,
        url: str,
        tls: TlsFiles,
        on_renewed: Callable[[], None],
        *,
        check_every_s: float = CHECK_EVERY_S,
        now: Callable[[], dt.datetime] = pki.utcnow,
    ) -> None:
        self.url = url
        self.tls = tls
        self.on_renewed = on_renewed
        self.check_every_s = check_every_s
        self.now = now
        self.renewed = 0
        self.failures = 0
        self.crl_updates = 0
        self.crl_failures = 0
        # Confirmed at start too: a swap whose confirmation was lost (or a crash between
        # them) is confirmed then; confirming a certificate already confirmed is a no-op.
        self.confirm_pending = True
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="cert-renewal", daemon=True)

    def start(self) -> None:
        complete_pending(self.tls)
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()

    def check(self) -> bool:
        """Fetch the fleet's CRL, renew if due (then confirm the new certificate); True
        if renewed."""
        self.refresh_crl()
        if self.confirm_pending:
            self.confirm()
        if not renewal_due(current(self.tls), self.now()):
            return False
        try:
            info = renew_certificate(self.url, self.tls)
        except (RenewalError, pki.CertificateError, OSError) as exc:
            self.failures += 1
            log.warning("certificate renewal failed (%s); retrying later", exc)
            return False
        self.renewed += 1
        log.info("certificate renewed; valid until %s", f"{info.not_after:%Y-%m-%d}")
        self.on_renewed()
        self.confirm_pending = True
        self.confirm()
        return True

    def refresh_crl(self) -> None:
        """Adopt the manager's CRL when it is the fleet CA's and newer; a failure keeps
        the one held and is retried at the next check."""
        try:
            if refresh_crl(self.url, self.tls):
                self.crl_updates += 1
        except (pki.CertificateError, OSError) as exc:
            self.crl_failures += 1
            log.warning("%s; keeping the CRL held, retrying at the next check", exc)

    def confirm(self) -> None:
        """Confirm the certificate in use; retried at the next check when it fails."""
        try:
            revoked = confirm_certificate(self.url, self.tls)
        except RenewalError as exc:
            log.warning("%s; retrying at the next check", exc)
            return
        self.confirm_pending = False
        if revoked:
            log.info("the manager revoked this station's %d older certificate(s)", revoked)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.check()
            except Exception:  # a thread that dies would never renew again
                log.exception("certificate renewal check failed")
            self._stop.wait(self.check_every_s)


def renewer_for(
    settings: AgentSettings, on_renewed: Callable[[], None]
) -> CertificateRenewer | None:
    """The station's renewer, or None (an --insecure agent, or no enrollment URL known)."""
    tls = settings.tls()
    if tls is None or not settings.enroll_url:
        return None
    return CertificateRenewer(settings.enroll_url, tls, on_renewed)

"""`fedge manager doctor`: what in a manager home weakens the fleet's security (issue 13).

Pure: every check is a function from plain facts (file modes, certificate end dates, the
broker's config text, the CRL's serials) to :class:`Finding` values; the facts are
gathered from a home by :mod:`fedge.edge_manager.doctor.facts`. A finding names a file,
a listener or a certificate's holder and says what to do -- never key material, a
password or a token (the facts carry none: modes, dates, serials and booleans only).

Checks, each reporting one "ok" finding when it finds nothing:

- ``certificate-expiry``: the CA, the server certificates, the manager's client
  certificate and every holder's newest unrevoked certificate in the store; expired is an
  error, expiring within :data:`EXPIRY_WARNING_DAYS` a warning (stations and `manager
  serve` renew far earlier, so a warning means renewal is not happening). The home's own
  certificates each get a finding with their days left (``days_left``), the stations'
  and operators' one summary with the soonest (issue 24).
- ``key-permissions``: private keys and secrets readable or writable by group/others,
  and directories holding them that others can write (they could swap the files).
- ``plain-listener``: a listener without mutual TLS; a warning in a development home
  (``--insecure``), an error otherwise.
- ``ca-key-encryption`` (doctor_ca.py): the CA key stored without a passphrase (a
  warning: the file is 0600, but a copied disk or backup then holds the fleet's root).
- ``crl`` (doctor_ca.py): a CRL that does not parse, is not the fleet CA's, has expired
  or will within :data:`EXPIRY_WARNING_DAYS`, or lacks a revocation recorded in the store;
  otherwise its days to next-update.
- ``secrets-in-logs``: a log file in the home holding a PEM private key.
- ``signing-key``: stations that refused a key rotation, a rotation cut short, stations
  not yet known to trust the current key (doctor_keys.py).
- ``store-space``, ``broker-save`` (doctor/storage.py, issue 33): the store unwritable
  or low on space, the broker's save file not written.
"""

import dataclasses
import datetime as dt
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from typing import Literal, get_args

from fedge.edge_manager.doctor.ca import CA_KEY_ENCRYPTION, CRL, check_ca_key, check_crl
from fedge.edge_manager.doctor.ca import CrlFact as CrlFact
from fedge.edge_manager.doctor.ca import RevokedFact as RevokedFact
from fedge.edge_manager.doctor.keys import (
    SIGNING_KEY,
    Judgement,
    SigningKeyFact,
    check_signing_key,
)
from fedge.edge_manager.doctor.storage import (
    BROKER_SAVE,
    STORE_SPACE,
    StorageFact,
    check_broker_save,
    check_store_space,
)

Severity = Literal["ok", "warning", "error"]
SEVERITIES: tuple[Severity, ...] = get_args(Severity)
EXPIRY_WARNING_DAYS = 30.0
# Permission bits: group/others may not touch a secret at all; no one but the owner may
# write a directory that holds one (sticky or not: the home is never a shared /tmp).
SECRET_FORBIDDEN_BITS = 0o077
DIR_FORBIDDEN_BITS = 0o002

CERTIFICATE_EXPIRY = "certificate-expiry"
KEY_PERMISSIONS = "key-permissions"
PLAIN_LISTENER = "plain-listener"
SECRETS_IN_LOGS = "secrets-in-logs"


@dataclass(frozen=True)
class Finding:
    severity: Severity
    check: str
    subject: str
    message: str
    days_left: float | None = None  # a credential's days until it ends (or the CRL's)

    def __post_init__(self) -> None:
        if self.severity not in SEVERITIES:
            raise ValueError(f"severity {self.severity!r} is not one of {', '.join(SEVERITIES)}")


@dataclass(frozen=True)
class CertFact:
    """One certificate's end date (``None`` with ``problem`` when it cannot be read).

    ``holder`` groups certificates of one identity: only its newest is judged, since a
    station that renewed keeps its old certificate, unrevoked, for a grace of 7 days
    (credential_renewal.py)."""

    subject: str
    not_after: dt.datetime | None
    problem: str = ""
    holder: str = ""


@dataclass(frozen=True)
class FileMode:
    path: str  # relative to the home
    mode: int  # permission bits (st_mode & 0o7777)


@dataclass(frozen=True)
class HomeFacts:
    insecure: bool
    now: dt.datetime
    certificates: tuple[CertFact, ...] = ()
    secret_files: tuple[FileMode, ...] = ()
    secret_dirs: tuple[FileMode, ...] = ()
    ca_key_encrypted: bool | None = None  # None: the home holds no CA key
    crl: CrlFact | None = None  # None: the home has no PKI (--insecure)
    revoked: tuple[RevokedFact, ...] = ()  # revoked in the store, still within validity
    broker_conf: str | None = None  # <home>/broker/mosquitto.conf, if the broker ran
    superlink_ran_plain: bool = False  # its flwr connection file says insecure = true
    logs_with_keys: tuple[str, ...] = ()
    signing_key: SigningKeyFact | None = None  # None: not looked at
    storage: StorageFact | None = None  # None: not looked at


def _ok(check: str, message: str) -> Finding:
    return Finding("ok", check, "home", message)


def _findings(check: str, judgements: Iterable[Judgement]) -> list[Finding]:
    """The (severity, subject, message) of doctor_ca.py's and doctor_keys.py's checks."""
    return [Finding(severity, check, subject, message) for severity, subject, message in judgements]


def _days(until: dt.datetime | None, now: dt.datetime) -> float | None:
    return None if until is None else round((until - now).total_seconds() / 86400.0, 1)


# -- certificates


def current_certificates(facts: Iterable[CertFact]) -> list[CertFact]:
    """Every certificate without a holder, and each holder's newest one (unreadable
    ones always: they are findings of their own)."""
    newest: dict[str, CertFact] = {}
    kept: list[CertFact] = []
    for fact in facts:
        if not fact.holder or fact.not_after is None:
            kept.append(fact)
            continue
        seen = newest.get(fact.holder)
        if seen is None or (seen.not_after is not None and fact.not_after > seen.not_after):
            newest[fact.holder] = fact
    return kept + list(newest.values())


def check_certificates(
    facts: Sequence[CertFact], now: dt.datetime, warn_days: float = EXPIRY_WARNING_DAYS
) -> list[Finding]:
    """Problems first; then the days left of each of the home's own certificates, and of
    the soonest-ending holder's (stations, operators: one line, not a thousand)."""
    findings: list[Finding] = []
    days_of_home: list[Finding] = []
    holders_fine: list[CertFact] = []
    judged = current_certificates(facts)
    for fact in judged:
        if fact.not_after is None:
            findings.append(
                Finding("error", CERTIFICATE_EXPIRY, fact.subject, f"unusable: {fact.problem}")
            )
            continue
        days = _days(fact.not_after, now)
        assert days is not None
        until = f"{fact.not_after:%Y-%m-%d %H:%M} UTC"
        if days <= 0:
            findings.append(
                Finding(
                    "error",
                    CERTIFICATE_EXPIRY,
                    fact.subject,
                    f"expired {until}: it is refused; {_renewal(fact)}",
                    days,
                )
            )
        elif days <= warn_days:
            findings.append(
                Finding(
                    "warning",
                    CERTIFICATE_EXPIRY,
                    fact.subject,
                    f"expires in {days:.0f} day(s) ({until}); {_renewal(fact)}",
                    days,
                )
            )
        elif fact.holder:
            holders_fine.append(fact)
        else:
            days_of_home.append(
                Finding(
                    "ok",
                    CERTIFICATE_EXPIRY,
                    fact.subject,
                    f"{days:.0f} day(s) left (until {until}); {_renewed_how(fact)}",
                    days,
                )
            )
    if not judged:
        findings.append(_ok(CERTIFICATE_EXPIRY, "no certificates: this home has no fleet CA"))
    findings += days_of_home
    if holders_fine:
        soonest = min(holders_fine, key=lambda f: f.not_after or now)
        days = _days(soonest.not_after, now)
        findings.append(
            Finding(
                "ok",
                CERTIFICATE_EXPIRY,
                "home",
                f"{len(holders_fine)} station/operator certificate(s) valid for more than "
                f"{warn_days:.0f} days; the soonest ends in {days:.0f} day(s) ({soonest.holder})",
                days,
            )
        )
    return findings


def _renewed_how(fact: CertFact) -> str:
    if fact.subject.startswith("CA "):
        return "the fleet CA is not renewed automatically"
    return "`manager serve` issues it again once a third of its validity is left"


def _renewal(fact: CertFact) -> str:
    if fact.holder.startswith("edge "):
        return "the station renews itself while it can reach the manager; else enrol it again"
    if fact.holder.startswith("operator "):
        return "remove and add the operator again (`fedge manager operator`)"
    if fact.subject.startswith("server ") or fact.subject.startswith("manager "):
        return (
            "`fedge manager serve` renews it once a third of its validity is left: is it "
            "running (with FEDGE_CA_PASSPHRASE if the CA key is encrypted)?"
        )
    return "create a new fleet CA and enrol every station again"


# -- file permissions


def check_permissions(files: Sequence[FileMode], directories: Sequence[FileMode]) -> list[Finding]:
    findings: list[Finding] = []
    for file in files:
        if file.mode & SECRET_FORBIDDEN_BITS:
            findings.append(
                Finding(
                    "error",
                    KEY_PERMISSIONS,
                    file.path,
                    f"mode {file.mode:04o}: group/others can read or change this secret; "
                    f"run chmod 600 {file.path} (and replace the secret if others read it)",
                )
            )
    for directory in directories:
        if directory.mode & DIR_FORBIDDEN_BITS:
            findings.append(
                Finding(
                    "error",
                    KEY_PERMISSIONS,
                    directory.path,
                    f"mode {directory.mode:04o}: anyone can replace the keys in this "
                    f"directory; run chmod o-w {directory.path}",
                )
            )
    if not findings:
        findings.append(
            _ok(KEY_PERMISSIONS, f"{len(files)} key and secret file(s) readable by the owner only")
        )
    return findings


# -- listeners


def _conf_lines(conf: str) -> list[str]:
    """Non-comment lines, whitespace normalised (``require_certificate  true``)."""
    return [
        " ".join(line.split())
        for line in conf.splitlines()
        if line.strip() and not line.lstrip().startswith("#")
    ]


def check_listeners(facts: HomeFacts) -> list[Finding]:
    if facts.insecure:
        return [
            Finding(
                "warning",
                PLAIN_LISTENER,
                name,
                "plain TCP with passwords: this is a development home (--insecure); "
                "for a plant network create a home without --insecure (mutual TLS)",
            )
            for name in ("broker", "grpc", "superlink")
        ]
    findings: list[Finding] = []
    if facts.broker_conf is not None:
        lines = _conf_lines(facts.broker_conf)
        if "require_certificate true" not in lines:
            findings.append(
                Finding(
                    "error",
                    PLAIN_LISTENER,
                    "broker",
                    "broker/mosquitto.conf lacks `require_certificate true`: the broker "
                    "admits clients without a fleet certificate; restart it with "
                    "`fedge manager broker` (which rewrites the config from this home)",
                )
            )
        if "allow_anonymous true" in lines:
            findings.append(
                Finding(
                    "error",
                    PLAIN_LISTENER,
                    "broker",
                    "broker/mosquitto.conf has `allow_anonymous true`; restart the broker "
                    "with `fedge manager broker`",
                )
            )
    if facts.superlink_ran_plain:
        findings.append(
            Finding(
                "error",
                PLAIN_LISTENER,
                "superlink",
                "the SuperLink last ran without TLS (its flwr connection says insecure); "
                "restart it with `fedge manager superlink`",
            )
        )
    if not findings:
        findings.append(
            _ok(PLAIN_LISTENER, "broker, gRPC and the SuperLink use TLS with fleet certificates")
        )
    return findings


def check_logs(logs_with_keys: Sequence[str]) -> list[Finding]:
    if not logs_with_keys:
        return [_ok(SECRETS_IN_LOGS, "no private key in the home's logs")]
    return [
        Finding(
            "error",
            SECRETS_IN_LOGS,
            path,
            "holds a PEM private key: delete the log and replace the key it shows",
        )
        for path in logs_with_keys
    ]


def diagnose(facts: HomeFacts) -> list[Finding]:
    """Every check over one home's facts, errors first."""
    findings = [
        *check_certificates(facts.certificates, facts.now),
        *check_permissions(facts.secret_files, facts.secret_dirs),
        *check_listeners(facts),
        *_findings(CA_KEY_ENCRYPTION, check_ca_key(facts.ca_key_encrypted)),
        *_crl_findings(facts),
        *check_logs(facts.logs_with_keys),
        *_findings(
            SIGNING_KEY,
            [] if facts.signing_key is None else check_signing_key(facts.signing_key),
        ),
        *_storage_findings(facts.storage),
    ]
    rank = {"error": 0, "warning": 1, "ok": 2}
    return sorted(findings, key=lambda f: rank[f.severity])


def _storage_findings(fact: StorageFact | None) -> list[Finding]:
    """doctor/storage.py's two checks (store-space, broker-save)."""
    if fact is None:
        return []
    return [
        *_findings(STORE_SPACE, check_store_space(fact)),
        *_findings(BROKER_SAVE, check_broker_save(fact)),
    ]


def _crl_findings(facts: HomeFacts) -> list[Finding]:
    """doctor_ca.py's CRL check, each finding with the days to the CRL's next-update."""
    next_update = None if facts.crl is None else facts.crl.next_update
    days = _days(next_update, facts.now)
    return [
        dataclasses.replace(finding, days_left=days)
        for finding in _findings(CRL, check_crl(facts.crl, facts.revoked, facts.now))
    ]


def counts(findings: Iterable[Finding]) -> dict[Severity, int]:
    tally: dict[Severity, int] = dict.fromkeys(SEVERITIES, 0)
    for finding in findings:
        tally[finding.severity] += 1
    return tally

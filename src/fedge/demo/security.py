"""The demo's security chapter: a station enrols with a one-time token, is revoked; the
manager's signing key rotates.

Everything in the demo already ran over mutual TLS with the fleet CA's certificates (the
broker listens on TLS only; the manager, every agent and the enrollment endpoint present
certificates). This chapter shows the credential lifecycle: a new station (st-09) makes
its key, enrols through the manager's HTTPS endpoint with a single-use token and comes
online; its token used again is refused; then it is revoked, and the broker refuses it
while the rest of the fleet carries on. Last, the manager's signing key is rotated and
every online station follows the rotation the old and the new key co-signed.
"""

from __future__ import annotations

import logging
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from rich.console import Console

from fedge.edge_agent.identity.enroll import EnrollmentRefused, enroll_device
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.reports import store as report_store
from fedge.edge_manager.security import credentials, key_rotation
from fedge.edge_manager.security.enrollment import invite, revoke
from fedge.edge_manager.store import Store
from fedge.protocols.pki import TlsFiles
from fedge.sim.processes import FedgeProcess
from fedge.transport import mqtt
from fedge.transport.mqtt import MqttSession
from fedge.transport.session import MqttSettings

NEW_EDGE = "st-09"


@dataclass
class SecurityChapter:
    ca_fingerprint: str = ""
    station_certificates: int = 0
    enrolled: str = NEW_EDGE
    token_to_online_s: float = 0.0
    replay: str = ""
    revoke_to_refused_s: float = 0.0
    broker_refused: bool = False  # the broker refused the revoked station's certificate
    push_after_revoke_s: float = 0.0
    old_key: str = ""
    new_key: str = ""
    rotation_to_all_s: float = 0.0  # until every online station said it trusts the new key
    stations_on_new_key: int = 0
    stations_online: tuple[str, ...] = ()  # when the key rotated
    stations_following: tuple[str, ...] = ()  # that reported trusting the new key
    push_after_rotation_s: float = 0.0


def _state(store: Store, edge: str) -> str | None:
    """``edge``'s state in the manager's store (None: not enrolled)."""
    row = report_store.edge_state(store, edge)
    return None if row is None else row.state


def _config_applied(store: Store, edge: str) -> int | None:
    """The config version ``edge`` last reported applied (None: not enrolled)."""
    row = report_store.edge_state(store, edge)
    return None if row is None else row.config_applied


def _broker_accepts(host: str, port: int, edge: str, tls: TlsFiles) -> bool:
    """One connection attempt: True if the broker accepted it, False as soon as it
    refused (a TLS alert, a dropped connection)."""
    # The refusal is what this probe waits for: the session's ERROR line about it would
    # read as a fault on the demo's terminal, so the transport's log is quiet meanwhile.
    transport_log = logging.getLogger(mqtt.__name__)
    level = transport_log.level
    transport_log.setLevel(logging.CRITICAL)
    session = MqttSession(MqttSettings(host, port, edge, tls=tls, clean_start=True))
    session.start()
    try:
        deadline = time.monotonic() + 5.0
        while time.monotonic() < deadline:
            if session.connected.is_set():
                return True
            if session.link.failures or session.link.last_error:
                return False
            time.sleep(0.01)
        return False
    finally:
        session.stop()
        transport_log.setLevel(level)


def run_security(
    out: Path, home: ManagerHome, fleet: Fleet, store: Store, console: Console, wait: Any
) -> SecurityChapter:
    """The chapter; ``wait(predicate, timeout_s, what)`` is the demo's poller."""
    console.rule("[bold]security: enrolment with a one-time token, revocation, key rotation")
    result = SecurityChapter(ca_fingerprint=home.pki().ca_fingerprint())
    settings = home.settings()

    started = time.monotonic()
    invitation = invite(home, NEW_EDGE, ttl_s=600)
    config = out / NEW_EDGE / "agent.toml"
    enrolled = enroll_device(settings.enroll_url, NEW_EDGE, str(invitation.token), config)
    agent = FedgeProcess(
        ["agent", "run", "--config", str(config)], out / "logs" / f"{NEW_EDGE}.log"
    ).start()
    try:
        wait(
            lambda: _state(store, NEW_EDGE) == "online",
            30,
            f"{NEW_EDGE} online",
        )
        result.token_to_online_s = time.monotonic() - started
        console.print(
            f"{NEW_EDGE}: key made on the device, enrolled over HTTPS with a single-use token "
            f"(CA pinned by the token), online in {result.token_to_online_s:.2f} s"
        )
        try:
            enroll_device(settings.enroll_url, NEW_EDGE, str(invitation.token), out / "again.toml")
            result.replay = "accepted"
        except EnrollmentRefused as exc:
            result.replay = str(exc)
        console.print(f"the same token again: {result.replay}")

        revoked_at = time.monotonic()
        revoke(home, NEW_EDGE)
        wait(
            lambda: (
                not _broker_accepts(
                    settings.local_broker_host, settings.broker_port, NEW_EDGE, enrolled.tls
                )
            ),
            30,
            f"the broker to refuse {NEW_EDGE}",
        )
        result.revoke_to_refused_s = time.monotonic() - revoked_at
        result.broker_refused = True
        console.print(
            f"revoked {NEW_EDGE}: the broker refuses its certificate within "
            f"{result.revoke_to_refused_s:.2f} s (CRL and ACL re-read)"
        )
    finally:
        agent.stop()

    pushed = fleet.set_threshold(["st-01"], 0.7)[0]
    result.push_after_revoke_s = wait(
        lambda: _config_applied(store, "st-01") == pushed.version,
        20,
        "a threshold on st-01 after the revocation",
    )
    result.station_certificates = sum(
        1 for c in credentials.certificates(store) if c.role == "edge"
    )
    console.print(
        f"the fleet carries on: a threshold pushed to st-01 applied in "
        f"{result.push_after_revoke_s:.2f} s; {result.station_certificates} station "
        f"certificates issued by CA {result.ca_fingerprint[:23]}…"
    )
    _rotate(home, fleet, store, console, wait, result)
    return result


def _rotate(
    home: ManagerHome,
    fleet: Fleet,
    store: Store,
    console: Console,
    wait: Any,
    result: SecurityChapter,
) -> None:
    """The manager's signing key rotates; the stations follow the rotation the old and
    the new key co-signed and from then on apply only what the new key signs."""
    # The stations up now; a revoked one (st-09 above) can no longer report anything.
    stations = {e.edge for e in key_rotation.trust_view(home).edges}
    online = [edge for edge in report_store.online_edges(store) if edge in stations]
    started = time.monotonic()
    rotated = key_rotation.rotate(home)
    fleet.use_key(home.signing_key())
    result.old_key, result.new_key = rotated.old_key_id, rotated.new_key_id

    def followed() -> bool:
        on_new = set(key_rotation.trust_view(home).on_current_key())
        return set(online) <= on_new

    wait(followed, 30, "every online station to trust the new key")
    result.rotation_to_all_s = time.monotonic() - started
    result.stations_online = tuple(sorted(online))
    result.stations_following = tuple(sorted(key_rotation.trust_view(home).on_current_key()))
    result.stations_on_new_key = len(result.stations_following)
    pushed = fleet.set_threshold(["st-01"], 0.68)[0]
    result.push_after_rotation_s = wait(
        lambda: _config_applied(store, "st-01") == pushed.version,
        20,
        "a threshold signed by the new key on st-01",
    )
    console.print(
        f"signing key rotated {rotated.old_key_id} -> {rotated.new_key_id}: all "
        f"{len(online)} online stations followed the rotation old and new key co-signed within "
        f"{result.rotation_to_all_s:.2f} s; a threshold the new key signed applied on st-01 "
        f"in {result.push_after_rotation_s:.2f} s"
    )


def report_lines(result: SecurityChapter) -> list[str]:
    return [
        "## Security",
        "",
        "Every connection above was mutual TLS with certificates of the fleet's own CA "
        f"(`{result.ca_fingerprint}`): the broker's only listener requires a client "
        "certificate and takes its name as the identity its per-edge ACL is written for; "
        "agent.toml files hold no secret (each station's key was made beside it, 0600).",
        "",
        f"- {result.enrolled} enrolled through the manager's HTTPS endpoint with a single-use "
        f"token and was online {result.token_to_online_s:.2f} s after the token was issued.",
        f"- The token used a second time: {result.replay}",
        f"- Revoked: the broker refused {result.enrolled}'s certificate "
        f"{result.revoke_to_refused_s:.2f} s after `revoke`; a threshold pushed to st-01 "
        f"afterwards applied in {result.push_after_revoke_s:.2f} s.",
        f"- Station certificates issued: {result.station_certificates}.",
        f"- The manager's signing key rotated from `{result.old_key}` to `{result.new_key}`: "
        f"{result.stations_on_new_key} stations reported following the rotation (signed by "
        f"the old key) within {result.rotation_to_all_s:.2f} s, and a threshold signed by "
        f"the new key applied on st-01 in {result.push_after_rotation_s:.2f} s. The old "
        "key signs nothing the stations accept any more.",
        "",
    ]


def summary(result: SecurityChapter) -> dict[str, Any]:
    return {
        "ca_fingerprint": result.ca_fingerprint,
        "station_certificates": result.station_certificates,
        "token_to_online_s": result.token_to_online_s,
        "replay": result.replay,
        "enrolled": result.enrolled,
        "revoke_to_refused_s": result.revoke_to_refused_s,
        "broker_refused": result.broker_refused,
        "push_after_revoke_s": result.push_after_revoke_s,
        "key_rotation": {
            "old_key": result.old_key,
            "new_key": result.new_key,
            "rotation_to_all_s": result.rotation_to_all_s,
            "stations_on_new_key": result.stations_on_new_key,
            "stations_online": list(result.stations_online),
            "stations_following": list(result.stations_following),
            "push_after_rotation_s": result.push_after_rotation_s,
        },
    }

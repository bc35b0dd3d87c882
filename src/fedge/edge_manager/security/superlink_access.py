"""The fleet's SuperLink under the manager home's PKI, and its SuperNode keys kept in step
with the certificates in the store (issue 13).

With TLS the SuperLink admits only SuperNodes whose key was registered, and a station's
SuperNode signs with the station's own TLS key; so the keys to register are the public
keys of the stations' newest valid certificates. :class:`KeySync` compares those with
what is registered every few seconds and (un)registers the difference: an enrolled
station can train, a renewed one trains with its new key (its SuperNode, refused with the
old one, is restarted by the agent's supervisor and reads the new), a revoked one is
refused at its next request. It runs where the SuperLink runs (`fedge manager superlink`,
the demo), so no other command needs to reach Flower's Control API.
"""

import logging
import threading

from fedge.aggregator.superlink.link import SuperLink, SuperLinkError, node_public_key
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.security import credentials
from fedge.edge_manager.store import Store

log = logging.getLogger(__name__)
SYNC_EVERY_S = 2.0


def fleet_superlink(home: ManagerHome) -> SuperLink:
    """The SuperLink of this home: HTTPS with node authentication, or plain (--insecure)."""
    settings = home.settings()
    tls = None if settings.insecure else home.pki().server_files("superlink")
    return SuperLink(
        home.root / "superlink", settings.superlink_host, settings.superlink_port, tls=tls
    )


def wanted_keys(store: Store) -> dict[str, str]:
    """Station -> the OpenSSH public key of its newest valid certificate."""
    return {
        edge: node_public_key(pem) for edge, pem in credentials.station_certificates(store).items()
    }


class KeySync:
    """Registers exactly the stations' current keys on ``link``; ``sync_once`` for tests
    and start-up, ``start`` for a thread that keeps it so."""

    def __init__(self, home: ManagerHome, link: SuperLink, every_s: float = SYNC_EVERY_S) -> None:
        self.home = home
        self.link = link
        self.every_s = every_s
        self.failures = 0
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, name="superlink-keys", daemon=True)

    def sync_once(self) -> tuple[list[str], list[str]]:
        """(added, removed) station names."""
        store = Store(self.home.db_path)
        try:
            wanted = wanted_keys(store)
        finally:
            store.close()
        added, removed = self.link.sync(wanted)
        for name in added:
            log.info("SuperNode key of %s registered", name)
        for name in removed:
            log.info("SuperNode key of %s unregistered", name)
        return added, removed

    def start(self) -> None:
        self._thread.start()

    def stop(self) -> None:
        self._stop.set()
        self._thread.join(timeout=30)

    def _run(self) -> None:
        while not self._stop.is_set():
            try:
                self.sync_once()
            except (SuperLinkError, OSError, ValueError) as exc:
                self.failures += 1
                log.warning("SuperNode keys not synchronised (%s); retrying", exc)
            self._stop.wait(self.every_s)

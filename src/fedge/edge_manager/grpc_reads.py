"""The manager's store as its gRPC services read it: model artifacts and manifests, a
station's password, its latest desired documents (the server's sources, transport/grpc).

Per-thread read connections: gRPC handler threads each get their own (sqlite objects are
per thread), never the serve loop's writer connection.
"""

import threading
from pathlib import Path

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome, ManagerSettings
from fedge.protocols.signing import SigningKey
from fedge.transport.grpc.contract import DesiredDocument


class StoreReads:
    """Per-thread read connections for gRPC handler threads (sqlite objects are per thread)."""

    def __init__(self, home: ManagerHome, settings: ManagerSettings, key: SigningKey) -> None:
        self.home = home
        self.settings = settings
        self.key = key
        self._local = threading.local()

    def _fleet(self) -> Fleet:
        fleet: Fleet | None = getattr(self._local, "fleet", None)
        if fleet is None:
            fleet = Fleet.open(self.home)
            self._local.fleet = fleet
        return fleet

    def manifest_envelope(self, name: str, version: int) -> bytes:
        return self._fleet().registry.manifest_envelope(name, version)

    def artifact_path(self, name: str, version: int) -> Path:
        return self._fleet().registry.artifact_path(name, version)

    def artifact_sha256(self, name: str, version: int) -> str:
        return self._fleet().registry.artifact_sha256(name, version)

    def authenticate(self, edge: str, token: str) -> bool:
        return self._fleet().authenticate(edge, token)

    def latest_desired(self, edge: str) -> list[DesiredDocument]:
        return [
            DesiredDocument(doc.kind, doc.version, doc.envelope.encode())
            for doc in desired_store.latest_desired(self._fleet().store, edge)
        ]

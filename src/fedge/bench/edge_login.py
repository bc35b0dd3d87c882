"""How one simulated edge of a benchmark logs in to the broker: a password or certificates.

The testbed makes these (:mod:`fedge.bench.testbed`) and hands them to helper processes
in their stdin spec; a plain run gives each edge its broker password, a mutual-TLS run
the *paths* of its certificate files (issue 13) -- a key's contents never travel in a
spec, and no credential ever sits on a command line.
"""

import json
import sys
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from fedge.bench.errors import BenchError
from fedge.protocols.pki import TlsFiles
from fedge.transport.session import MqttSettings


def emit(event: dict[str, Any]) -> None:
    """One event line to the parent on stdout (the helper processes' half of the talk)."""
    sys.stdout.write(json.dumps(event) + "\n")
    sys.stdout.flush()


class EdgeLoginError(BenchError, ValueError):
    """A spec line's login entry is malformed (a bug in the parent, not user input)."""


@dataclass(frozen=True)
class EdgeLogin:
    """Exactly one of ``password`` (plain TCP) and ``tls`` (mutual TLS) is set."""

    edge: str
    password: str | None = field(default=None, repr=False)
    tls: TlsFiles | None = None

    def __post_init__(self) -> None:
        if (self.password is None) == (self.tls is None):
            raise EdgeLoginError(f"{self.edge}: give a password or certificate files, not both")

    def to_json(self) -> dict[str, str]:
        if self.tls is None:
            assert self.password is not None
            return {"edge": self.edge, "password": self.password}
        return {
            "edge": self.edge,
            "ca": str(self.tls.ca),
            "cert": str(self.tls.cert),
            "key": str(self.tls.key),
        }

    def mqtt_settings(self, host: str, port: int, **options: Any) -> MqttSettings:
        """The edge's MQTT session to ``host:port`` as an agent would open it."""
        return MqttSettings(
            host=host,
            port=port,
            client_id=self.edge,
            # Under TLS the certificate names the user: no username or password.
            username=None if self.tls is not None else self.edge,
            password=self.password,
            tls=self.tls,
            **options,
        )

    @classmethod
    def from_json(cls, data: Any) -> "EdgeLogin":
        if not isinstance(data, dict) or not isinstance(data.get("edge"), str):
            raise EdgeLoginError(f"not an edge login: {type(data).__name__}")
        edge = str(data["edge"])
        if "password" in data:
            return cls(edge, password=str(data["password"]))
        try:
            files = TlsFiles(ca=Path(data["ca"]), cert=Path(data["cert"]), key=Path(data["key"]))
        except KeyError as exc:
            raise EdgeLoginError(f"{edge}: no password and no {exc.args[0]} file") from None
        return cls(edge, tls=files)

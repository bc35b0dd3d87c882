"""The app signatures the manager made, kept beside its SuperLink (one file per FAB).

``fedge aggregator run`` writes the signature of each FAB it submits here *before* it
submits it; the SuperLink's front (:mod:`fedge.aggregator.superlink.front`) reads it when a
station fetches that FAB. A FAB with no file here reaches stations unsigned, and they
refuse it. The files hold signatures only: what they sign is checked by the stations.
"""

from __future__ import annotations

import os
from pathlib import Path

from fedge.protocols.app_signing import AppSignature
from fedge.protocols.errors import SignatureError

DIRNAME = "signed-apps"


class SignedApps:
    """``<superlink workdir>/signed-apps/<digest>.json``."""

    def __init__(self, directory: Path) -> None:
        self.directory = directory

    @classmethod
    def of(cls, superlink_workdir: Path) -> SignedApps:
        return cls(superlink_workdir / DIRNAME)

    def put(self, signature: AppSignature) -> Path:
        """Store ``signature`` (atomically: a reader sees the whole file or none)."""
        self.directory.mkdir(parents=True, exist_ok=True)
        path = self.directory / f"{signature.digest}.json"
        tmp = path.with_suffix(f".{os.getpid()}.tmp")
        tmp.write_bytes(signature.encode())
        tmp.replace(path)
        return path

    def get(self, digest: str) -> AppSignature | None:
        """The signature stored for the FAB with hex SHA-256 ``digest``; None if none (or
        if the file is not one: logged by the caller as an unsigned FAB)."""
        if len(digest) != 64 or any(c not in "0123456789abcdef" for c in digest):
            return None
        try:
            raw = (self.directory / f"{digest}.json").read_bytes()
        except OSError:
            return None
        try:
            signature = AppSignature.decode(raw)
        except SignatureError:
            return None
        return signature if signature.digest == digest else None

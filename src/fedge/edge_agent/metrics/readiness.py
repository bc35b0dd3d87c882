"""Whether a station is ready to score (``/readyz`` on its local API, issue 27): a pure rule
over what the agent knows, and the write probe of its data directory."""

import os
from pathlib import Path

from fedge.transport.metrics import Readiness

PROBE_BYTES = 4096


def agent_readiness(*, uplink: str | None, store_writable: str | None, serving: str) -> Readiness:
    """Ready when its reports can leave (the broker, or gRPC where MQTT is not used), its
    data directory takes writes and a model serves."""
    return Readiness(
        {
            "uplink": uplink,
            "store": store_writable,
            "model": None if serving else "no model deployed yet; deploy one with `fedge deploy`",
        }
    )


def uplink_problem(*, broker_connected: bool, via_grpc: bool) -> str | None:
    """None while reports can leave: over MQTT while connected, or over gRPC while the
    agent polls there (report_via = "grpc", or MQTT down past its fallback time)."""
    if broker_connected or via_grpc:
        return None
    return "not connected to the broker (reports wait in the outbox)"


def write_problem(directory: Path) -> str | None:
    """Write, sync and remove a small file in ``directory``: None if that worked, else why
    not (a full disk or lost permissions: predictions could not be recorded)."""
    path = directory / f".ready-probe-{os.getpid()}"
    try:
        fd = os.open(path, os.O_WRONLY | os.O_CREAT | os.O_TRUNC, 0o600)
        try:
            if os.write(fd, b"\0" * PROBE_BYTES) < PROBE_BYTES:
                raise OSError(28, "No space left on device")
            os.fsync(fd)
        finally:
            os.close(fd)
    except OSError as exc:
        return f"cannot write in {directory}: {exc.strerror or exc}"
    finally:
        path.unlink(missing_ok=True)
    return None

"""Start and stop ``fedge`` subprocesses (demo, benchmarks, tests)."""

import os
import signal
import subprocess
import sys
from pathlib import Path


def fedge_executable() -> str:
    candidate = Path(sys.executable).parent / "fedge"
    return str(candidate) if candidate.exists() else "fedge"


class FedgeProcess:
    """One ``fedge ...`` process with its output in a log file."""

    def __init__(self, args: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.args = args
        self.log_path = log_path
        self.env = {**os.environ, **(env or {})}
        self.process: subprocess.Popen[bytes] | None = None

    def start(self) -> "FedgeProcess":
        if self.alive:
            raise RuntimeError(f"fedge {' '.join(self.args)} is already running")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with self.log_path.open("ab") as log:
            self.process = subprocess.Popen(
                [fedge_executable(), *self.args],
                stdout=log,
                stderr=subprocess.STDOUT,
                env=self.env,
            )
        return self

    def stop(self, *, kill: bool = False, timeout_s: float = 5.0) -> None:
        if self.process is None or self.process.poll() is not None:
            return
        self.process.send_signal(signal.SIGKILL if kill else signal.SIGTERM)
        try:
            self.process.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            self.process.kill()
            self.process.wait()

    @property
    def alive(self) -> bool:
        return self.process is not None and self.process.poll() is None

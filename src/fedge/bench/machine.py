"""What a benchmark ran on: every result carries this, so numbers are never orphaned."""

import importlib.metadata
import os
import platform
import socket
import sqlite3
import subprocess
import sys
from pathlib import Path
from typing import Any

from fedge import __version__
from fedge.transport.broker import mosquitto_binary
from fedge.transport.errors import BrokerError


def _cpu_model() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


def _total_ram_bytes() -> int | None:
    try:
        for line in Path("/proc/meminfo").read_text().splitlines():
            if line.startswith("MemTotal:"):
                return int(line.split()[1]) * 1024  # the kernel reports kB
    except (OSError, ValueError, IndexError):
        pass
    return None


def _package_version(name: str) -> str | None:
    try:
        return importlib.metadata.version(name)
    except importlib.metadata.PackageNotFoundError:
        return None


def _mosquitto_version() -> str | None:
    try:
        binary = mosquitto_binary()
    except BrokerError:
        return None
    # `mosquitto -h` prints its usage (version on the first line) and exits non-zero.
    result = subprocess.run([binary, "-h"], capture_output=True, text=True, check=False, timeout=10)
    lines = (result.stdout or result.stderr).strip().splitlines()
    return lines[0].strip() if lines else None


def machine_info() -> dict[str, Any]:
    ram = _total_ram_bytes()
    return {
        "hostname": socket.gethostname(),
        "platform": platform.platform(),
        "python": sys.version.split()[0],
        "cpu_count": os.cpu_count(),
        "cpu_model": _cpu_model(),
        "ram_total_bytes": ram,
        "ram_total_gib": None if ram is None else round(ram / 2**30, 1),
        "versions": {
            "fedge": __version__,
            "onnxruntime": _package_version("onnxruntime"),
            "paho-mqtt": _package_version("paho-mqtt"),
            "mosquitto": _mosquitto_version(),
            "numpy": _package_version("numpy"),
            "sqlite": sqlite3.sqlite_version,
        },
    }


def machine_line(info: dict[str, Any]) -> str:
    """One line for reports: ``host: 2 x CPU model, 23.4 GiB, Python 3.11.2, ...``."""
    versions = info.get("versions", {})
    return (
        f"{info.get('hostname')}: {info.get('cpu_count')} x {info.get('cpu_model')}, "
        f"{info.get('ram_total_gib')} GiB RAM, {info.get('platform')}, "
        f"Python {info.get('python')}, onnxruntime {versions.get('onnxruntime')}, "
        f"paho-mqtt {versions.get('paho-mqtt')}, {versions.get('mosquitto')}"
    )

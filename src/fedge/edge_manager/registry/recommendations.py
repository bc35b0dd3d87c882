"""Per-station anomaly thresholds recommended with an anomaly model version (issue 28).

An anomaly fleet job ends with every station scoring its own held-out good parts with the
fitted model and reporting the score quantile at the job's false-alarm rate
(``anomaly-thresholds.json`` in the job directory). Publishing the model copies them
here, beside the version's artifact (``<artifacts>/<name>/<version>/``): they belong to
that version -- a refit moves every score -- and to each station, so they cannot be the
manifest's recommended thresholds (those are probabilities, one set for every station).
``fedge edge set-threshold EDGE --anomaly recommended`` reads them for the anomaly model
deployed beside the edge's classifier. A plain JSON file: the registry's directory is the
place a version's files live, and nothing queries it.
"""

import json
import math
from collections.abc import Mapping
from pathlib import Path

from fedge.edge_manager.errors import ManagerError

FILE = "anomaly-thresholds.json"


def path_of(artifacts: Path, name: str, version: int) -> Path:
    return artifacts / name / str(version) / FILE


def write_anomaly_thresholds(
    artifacts: Path, name: str, version: int, reported: Mapping[str, Mapping[str, object]]
) -> Path:
    """Keep each station's reported threshold (``{edge: {"threshold": t, ...}}``) with
    ``name:version``; the stations' other figures (held-out count, share under it) too,
    and for a station that set none its ``reason``."""
    path = path_of(artifacts, name, version)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps({k: dict(v) for k, v in reported.items()}, indent=1, sort_keys=True))
    tmp.replace(path)
    return path


def recommended_anomaly_threshold(artifacts: Path, name: str, version: int, edge: str) -> float:
    """``edge``'s own threshold for ``name:version``, or ManagerError saying why none."""
    path = path_of(artifacts, name, version)
    try:
        data = json.loads(path.read_text(encoding="utf-8"))
    except FileNotFoundError:
        raise ManagerError(
            f"{name}:{version} was published with no stations' anomaly thresholds (not by "
            "an anomaly fleet job, or before they were kept); give a value: "
            "fedge edge set-threshold EDGE --anomaly VALUE"
        ) from None
    except (OSError, ValueError) as exc:
        raise ManagerError(f"cannot read {path}: {exc}; give a value instead") from None
    entry = data.get(edge) if isinstance(data, dict) else None
    value = entry.get("threshold") if isinstance(entry, dict) else None
    if not isinstance(value, int | float) or not math.isfinite(value) or value <= 0:
        reason = entry.get("reason") if isinstance(entry, dict) else None
        if isinstance(reason, str) and reason:
            why = f"it said: {reason[:400]}"
        else:
            reporting = sorted(
                e for e, v in data.items() if isinstance(v, dict) and "threshold" in v
            ) if isinstance(data, dict) else []  # fmt: skip
            why = (
                f"it took no part in the job (stations that did: {', '.join(reporting) or 'none'})"
            )
        raise ManagerError(
            f"{edge} reported no anomaly threshold for {name}:{version}; {why}; give a "
            "value: fedge edge set-threshold EDGE --anomaly VALUE"
        )
    return float(value)

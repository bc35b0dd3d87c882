"""The manifests a sweep writes: each trial's simulated job (the base manifest with the
trial's settings) and the best setting as a fleet job manifest, checked by the same
parsers that ``fedge aggregator run`` and ``fedge jobs submit --manifest`` use.
"""

from __future__ import annotations

import copy
import json
import math
import tomllib
from collections.abc import Mapping

from fedge.aggregator.fleet.manifest import parse_fleet_manifest
from fedge.aggregator.jobs.spec import ManifestError
from fedge.sim.job_manifest import JobManifest, load_manifest, parse_manifest
from fedge.sim.sweep.spec import SweepError, SweepSpec

# Settings of the party's local step: a simulated job takes them as strategy parameters,
# a fleet job in its [task].
_LOCAL_STEP = ("lr", "local_epochs", "batch_size")


def base_document(spec: SweepSpec) -> tuple[JobManifest, dict[str, object]]:
    """The base manifest, validated, and its TOML document with the scenario made absolute
    (the trials' manifests live elsewhere)."""
    try:
        manifest = load_manifest(spec.base_manifest)
    except ManifestError as exc:
        raise SweepError(f"base.manifest {spec.base_manifest}: {exc}") from None
    if manifest.federation.backend != "inprocess":
        raise SweepError(
            f"base.manifest: a sweep runs on the simulated fleet; its backend is "
            f"{manifest.federation.backend!r}, give 'inprocess'"
        )
    document = tomllib.loads(manifest.text)
    task = document.setdefault("task", {})
    assert isinstance(task, dict)
    task["scenario"] = str(manifest.task.scenario_file)
    if "noise_multiplier" in spec.space and _privacy(document) is None:
        raise SweepError(
            "space.noise_multiplier is DP-SGD's sigma, but the base manifest has no [privacy]"
        )
    return manifest, document


def trial_text(
    spec: SweepSpec, document: Mapping[str, object], job_name: str, params: Mapping[str, float]
) -> str:
    """The trial's simulated job manifest, checked (a bad combination raises SweepError)."""
    trial = copy.deepcopy(dict(document))
    job = _sub(trial, "job")
    job["name"] = job_name
    if spec.base_rounds is not None:
        job["rounds"] = spec.base_rounds
    strategy_params = _sub(_sub(trial, "strategy"), "params")
    for key, value in params.items():
        if key == "noise_multiplier":
            privacy = _privacy(trial)
            assert privacy is not None  # base_document checked
            privacy.pop("epsilon", None)  # a fixed sigma replaces the derived one
            privacy["noise_multiplier"] = value
        else:
            strategy_params[key] = value
    text = dumps(trial)
    try:
        parse_manifest(text, source=job_name)
    except ManifestError as exc:
        raise SweepError(f"trial {job_name} with {dict(params)}: {exc}") from None
    return text


def fleet_text(spec: SweepSpec, manifest: JobManifest, params: Mapping[str, float]) -> str:
    """The best setting as a fleet job manifest for ``fedge jobs submit --manifest``."""
    target = spec.fleet
    document = tomllib.loads(manifest.text)
    strategy = dict(_sub(document, "strategy"))
    strategy_params = {
        k: v for k, v in dict(_sub(strategy, "params")).items() if k not in _LOCAL_STEP
    }
    task: dict[str, object] = {"model": target.model}
    for key in _LOCAL_STEP:
        value = params.get(key, manifest.strategy.params.get(key))
        if value is not None:
            task[key] = value
    privacy = _privacy(document)
    for key, value in params.items():
        if key == "noise_multiplier" and privacy is not None:
            privacy.pop("epsilon", None)
            privacy["noise_multiplier"] = value
        elif key not in _LOCAL_STEP:
            strategy_params[key] = value
    out: dict[str, object] = {
        "job": {
            "name": target.name,
            "rounds": target.rounds or manifest.rounds,
            "seed": manifest.seed,
        },
        "task": task,
        "strategy": {"kind": manifest.strategy.kind, "params": strategy_params},
        "federation": {"backend": "fleet", "fleet": target.fleet, "edges": target.edges},
    }
    if privacy is not None and "privacy" in document:
        out["privacy"] = privacy
    elif privacy is not None:
        _sub(out["strategy"], "params")["privacy"] = privacy
    text = dumps(out)
    try:
        parse_fleet_manifest(text, source="best setting")
    except ManifestError as exc:
        raise SweepError(f"the best setting is not a valid fleet job: {exc}") from None
    return text


def _sub(table: object, key: str) -> dict[str, object]:
    assert isinstance(table, dict)
    value = table.setdefault(key, {})
    assert isinstance(value, dict)
    return value


def _privacy(document: Mapping[str, object]) -> dict[str, object] | None:
    if isinstance(document.get("privacy"), dict):
        return document["privacy"]  # type: ignore[return-value]
    strategy = document.get("strategy")
    params = strategy.get("params") if isinstance(strategy, dict) else None
    privacy = params.get("privacy") if isinstance(params, dict) else None
    return privacy if isinstance(privacy, dict) else None


def dumps(document: Mapping[str, object], prefix: str = "") -> str:
    """TOML for a manifest's document: scalars and lists of scalars, nested tables."""
    lines = [f"{key} = {_value(value)}" for key, value in document.items() if not _is_table(value)]
    out = ("\n".join(lines) + "\n") if lines else ""
    for key, value in document.items():
        if _is_table(value):
            name = f"{prefix}.{key}" if prefix else key
            assert isinstance(value, Mapping)
            out += f"\n[{name}]\n" + dumps(value, name)
    return out


def _is_table(value: object) -> bool:
    return isinstance(value, Mapping)


def _value(value: object) -> str:
    if isinstance(value, bool):
        return "true" if value else "false"
    if isinstance(value, int):
        return str(value)
    if isinstance(value, float):
        if not math.isfinite(value):
            raise SweepError(f"cannot write {value} in a manifest")
        return repr(value)
    if isinstance(value, str):
        return json.dumps(value)  # a TOML basic string
    if isinstance(value, list):
        return "[" + ", ".join(_value(v) for v in value) + "]"
    raise SweepError(f"cannot write {value!r} in a manifest")

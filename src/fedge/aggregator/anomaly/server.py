"""The ``ServerApp`` of an anomaly job: one statistics message per station, one sum.

Run config: ``initial`` (the backbone's weights, .npz), ``model-spec`` (JSON), ``nodes``
(stations to wait for), ``out`` (a directory), optional ``timeout-s`` (default 300) and
the ``anomaly-*`` keys the stations read (:mod:`fedge.party.anomaly_round`).

Writes ``<out>/model.npz`` (the fitted model, :func:`~fedge.models.anomaly.statistics.
fit_to_arrays`, plus the summed statistics under ``sum-*``) and ``<out>/result.json``
(good parts per station, failures, duplicates, each station's threshold), or
``{"error": ...}`` in ``result.json`` when the job fails. Publishing the exported model
in the registry is the fleet job's (not wired yet: see issue 28).
"""

import json
from collections.abc import Iterable
from pathlib import Path
from typing import Any

import numpy as np
from flwr.app import Array, ArrayRecord, ConfigRecord, Context, Message, RecordDict
from flwr.serverapp import Grid, ServerApp

from fedge.aggregator.anomaly.combine import FleetFit, StationReply, combine
from fedge.aggregator.fleet.grids import wait_for_nodes
from fedge.models.anomaly import AnomalyError
from fedge.models.anomaly.statistics import (
    COUNT_KEY,
    FLEET_KEY,
    fit_to_arrays,
    statistics_from_arrays,
    statistics_to_arrays,
    statistics_to_moments,
)

app = ServerApp()
ConfigValue = (
    int
    | float
    | str
    | bytes
    | bool
    | list[int]
    | list[float]
    | list[str]
    | list[bytes]
    | list[bool]
)

_PASSED_ON = (
    "anomaly-stages",
    "anomaly-input-scale",
    "anomaly-clip",
    "anomaly-good-class",
    "anomaly-false-alarm-rate",
)


@app.main()
def main(grid: Grid, context: Context) -> None:
    out = Path(str(context.run_config["out"]))
    out.mkdir(parents=True, exist_ok=True)
    try:
        _serve(grid, context.run_config, out)
    except BaseException as exc:  # whoever waits on the file learns why
        (out / "result.json").write_text(json.dumps({"error": f"{type(exc).__name__}: {exc}"}))
        raise


def _serve(grid: Grid, config: Any, out: Path) -> None:
    nodes = int(config["nodes"])
    timeout_s = float(config.get("timeout-s", 300))
    wait_for_nodes(grid, nodes, timeout_s)
    node_ids = sorted(grid.get_node_ids())
    with np.load(str(config["initial"]), allow_pickle=False) as npz:
        backbone = _record({k: npz[k] for k in npz.files})
    round_config: dict[str, ConfigValue] = {"model-spec": str(config["model-spec"])}
    round_config.update({k: config[k] for k in _PASSED_ON if k in config})

    # Error replies carry no content: learn each node's edge id first, to name failures.
    queries = [_message(grid, node, "query", {}) for node in node_ids]
    edges = {
        int(r.metadata.src_node_id): _edge(r, {})
        for r in grid.send_and_receive(queries, timeout=timeout_s)
    }
    train = [
        _message(grid, node, "train", {"arrays": backbone, "config": ConfigRecord(round_config)})
        for node in node_ids
    ]
    replies = grid.send_and_receive(train, timeout=timeout_s)
    fleet = combine([_station_reply(r, edges) for r in replies])
    model_arrays = fit_to_arrays(fleet.model)
    sums = {f"sum-{k}": v for k, v in statistics_to_arrays(fleet.summed).items()}
    _save_npz(out / "model.npz", {**model_arrays, **sums})

    evaluate = [
        _message(
            grid,
            node,
            "evaluate",
            {
                "arrays": backbone,
                "model": _record(model_arrays),
                # The pooled moments: each station scores its own parts left out of the fit.
                FLEET_KEY: _record(
                    {
                        **statistics_to_moments(fleet.summed),
                        COUNT_KEY: np.array([fleet.summed.count], dtype=np.float64),
                    }
                ),
                "config": ConfigRecord(round_config),
            },
        )
        for node in node_ids
    ]
    thresholds = _thresholds(grid.send_and_receive(evaluate, timeout=timeout_s), edges)
    (out / "result.json").write_text(json.dumps(_summary(fleet, thresholds), indent=2))


def _save_npz(path: Path, arrays: dict[str, Any]) -> None:
    np.savez(path, **arrays)


def _record(arrays: dict[str, Any]) -> ArrayRecord:
    return ArrayRecord(array_dict={k: Array(np.ascontiguousarray(v)) for k, v in arrays.items()})


def _message(grid: Grid, node: int, kind: str, records: dict[str, Any]) -> Message:
    return Message(content=RecordDict(records), dst_node_id=node, message_type=kind)


def _edge(reply: Message, edges: dict[int, str]) -> str:
    """The station's edge id from its reply, else from its query, else its node id."""
    if not reply.has_error():
        identity = reply.content.config_records.get("identity")
        if identity is not None and isinstance(identity.get("edge"), str):
            return str(identity["edge"])
    node = int(reply.metadata.src_node_id)
    return edges.get(node, f"node-{node}")


def _station_reply(reply: Message, edges: dict[int, str]) -> StationReply:
    node = int(reply.metadata.src_node_id)
    edge = _edge(reply, edges)
    if reply.has_error():
        return StationReply(node, edge, None, reply.error.reason)
    content = reply.content
    try:
        arrays = content.array_records["arrays"]
        stats = statistics_from_arrays({k: v.numpy() for k, v in arrays.items()})
    except (KeyError, AnomalyError) as exc:
        return StationReply(node, edge, None, f"bad statistics reply: {exc}")
    return StationReply(node, edge, stats)


def _thresholds(replies: Iterable[Message], edges: dict[int, str]) -> dict[str, Any]:
    result: dict[str, Any] = {}
    for reply in replies:
        if reply.has_error():
            result[_edge(reply, edges)] = {"error": reply.error.reason}
        else:
            result[_edge(reply, edges)] = dict(reply.content.metric_records["metrics"])
    return result


def _summary(fleet: FleetFit, thresholds: dict[str, Any]) -> dict[str, Any]:
    return {
        "good_parts": fleet.counts,
        "total_good_parts": fleet.summed.count,
        "failures": fleet.failures,
        "duplicates": list(fleet.duplicates),
        "grid": list(fleet.model.grid),
        "feature_dims": fleet.summed.dims,
        "thresholds": thresholds,
    }

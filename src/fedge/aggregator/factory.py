"""Build a strategy from its kind and a parameter table (job manifests, scenarios).

Unknown kinds and parameters are errors that name the offending key, raised before
anything starts.
"""

from collections.abc import Mapping
from typing import Any

from fedge.aggregator.clock import ClockMode
from fedge.aggregator.streaming import DeadlineConfig, StreamingFedAvg
from fedge.aggregator.tiered import TieredFedAvg
from fedge.errors import FedgeError

KINDS = ("fedavg", "fedprox", "tiered")
_DEADLINE: dict[str, type | tuple[type, ...]] = {
    "over_selection": float,
    "quorum_fraction": float,
    "deadline_factor": float,
    "late_policy": str,
    "staleness_exponent": float,
}
_TIERED: dict[str, type | tuple[type, ...]] = {
    "tiers": int,
    "profiling_rounds": int,
    "profiling_deadline_s": float,
    "adaptive": bool,
    "interval": int,
    "credits_per_tier": (int, list),
    "static_probabilities": list,
    "retier_interval": int,
    "dropout_threshold_s": float,
}
_FEDPROX: dict[str, type | tuple[type, ...]] = {"proximal_mu": float}


class StrategyConfigError(FedgeError):
    """A strategy table names an unknown kind or parameter, or a bad value."""


def _typed(table: str, key: str, value: object, kind: type | tuple[type, ...]) -> Any:
    if isinstance(kind, tuple):
        for option in kind:
            try:
                return _typed(table, key, value, option)
            except StrategyConfigError:
                continue
        names = " or ".join(k.__name__ for k in kind)
        raise StrategyConfigError(
            f"{table}.{key}: expected {names}, got {type(value).__name__} ({value!r})"
        )
    if kind is float and isinstance(value, int | float) and not isinstance(value, bool):
        return float(value)
    if kind is int and isinstance(value, int) and not isinstance(value, bool):
        return value
    if isinstance(value, kind):
        return value
    raise StrategyConfigError(
        f"{table}.{key}: expected {kind.__name__}, got {type(value).__name__} ({value!r})"
    )


def build_strategy(
    name: str,
    params: Mapping[str, object],
    *,
    per_round: int,
    seed: int,
    clock: ClockMode,
) -> tuple[StreamingFedAvg, dict[str, float]]:
    """The strategy and the extra train config it needs (e.g. FedProx's mu)."""
    table = f"strategies.{name}"
    kind = str(params.get("kind", name))
    if kind not in KINDS:
        raise StrategyConfigError(f"{table}.kind: unknown strategy {kind!r} (known: {KINDS})")
    allowed = dict(_DEADLINE)
    if kind == "tiered":
        allowed |= _TIERED
    if kind == "fedprox":
        allowed |= _FEDPROX
    values: dict[str, Any] = {}
    for key, value in params.items():
        if key == "kind":
            continue
        if key not in allowed:
            raise StrategyConfigError(
                f"{table}.{key}: not a parameter of {kind} (known: {sorted(allowed)})"
            )
        values[key] = _typed(table, key, value, allowed[key])
    try:
        deadline = DeadlineConfig(**{k: values.pop(k) for k in list(values) if k in _DEADLINE})
        train_config: dict[str, float] = {}
        if kind == "fedprox":
            train_config["proximal-mu"] = values.pop("proximal_mu", 0.01)
        if kind == "tiered":
            if "tiers" in values:
                values["n_tiers"] = values.pop("tiers")
            strategy: StreamingFedAvg = TieredFedAvg(
                per_round=per_round, seed=seed, clock=clock, deadline=deadline, **values
            )
        else:
            strategy = StreamingFedAvg(
                per_round=per_round, seed=seed, clock=clock, deadline=deadline
            )
    except (ValueError, TypeError) as exc:
        raise StrategyConfigError(f"{table}: {exc}") from None
    return strategy, train_config

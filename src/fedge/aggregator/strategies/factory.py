"""Build a strategy from its kind and a parameter table (job manifests, scenarios).

Unknown kinds and parameters are errors that name the offending key, raised before
anything starts.

Every kind but ``distill`` and ``nested`` takes a server optimizer (``server_opt`` = ``fedadam``,
``fedyogi``, ``fedadagrad`` or ``fedavgm``, with ``server_lr``, ``beta1``, ``beta2``,
``tau``; :mod:`fedge.aggregator.strategies.server_opt`), whatever its tiers, deadline,
late policy and privacy: the step is taken on the round's folded mean.
"""

from collections.abc import Mapping
from typing import TYPE_CHECKING, Any

from fedge.aggregator.errors import AggregatorError
from fedge.aggregator.privacy import central_dp
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.deadline import DeadlineConfig
from fedge.aggregator.strategies.server_opt import NAMES as SERVER_OPTIMIZERS
from fedge.aggregator.strategies.server_opt import ServerOptConfig
from fedge.aggregator.strategies.streaming import StreamingFedAvg
from fedge.aggregator.strategies.tiered import TieredFedAvg
from fedge.privacy.settings import PrivacyError, PrivacyMode, PrivacySpec

if TYPE_CHECKING:
    import numpy as np

    from fedge.models.architectures import Architectures

# distill also needs the server's unlabeled proxy set (``proxy_X``): the simulator and jobs
# pass their scenario's proxy split.
KINDS = ("fedavg", "fedprox", "tiered", "distill", "nested")
# The kinds that give each TiFL tier its own architecture (``tier_archs``): FedDF's
# distillation across any architectures, HeteroFL's nested slices of one model.
TIER_ARCH_KINDS = ("distill", "nested")
TIERED_KINDS = ("tiered", *TIER_ARCH_KINDS)
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
# ``[strategies.<name>.privacy]``: DP-SGD, central DP, SecAgg+ (fedge.privacy.settings).
_PRIVACY: dict[str, type | tuple[type, ...]] = {"privacy": dict}
_DISTILL: dict[str, type | tuple[type, ...]] = {
    "tier_archs": list,
    "temperature": float,
    "distill_epochs": int,
    "distill_lr": float,
    "distill_batch_size": int,
    "distill_validation": float,
    "distill_patience": int,
}
_NESTED: dict[str, type | tuple[type, ...]] = {"tier_archs": list}
# The server optimizer (FedOpt, Reddi et al. ICLR'21; FedAvgM, Hsu et al. 2019).
_SERVER_OPT: dict[str, type | tuple[type, ...]] = {
    "server_opt": str,
    "server_lr": float,
    "beta1": float,
    "beta2": float,
    "tau": float,
}
# Every kind but distill and nested (whose architectures follow the tiers) may set the
# trained arch.
_ARCH: dict[str, type | tuple[type, ...]] = {"arch": str}
# A strategy's own local step (over the scenario's or job's task): e.g. DP-SGD's larger
# batch at the same epsilon (its noise re-planned by the accountant) and its learning rate.
_LOCAL_STEP: dict[str, tuple[str, type]] = {
    "lr": ("lr", float),
    "batch_size": ("batch-size", int),
    "local_epochs": ("local-epochs", int),
}
LOCAL_STEP_KEYS = frozenset(key for key, _ in _LOCAL_STEP.values())
"""The train config keys a strategy's own local step sets (every runner applies them)."""


class StrategyConfigError(AggregatorError):
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


def optimizer_as_kind(kind: str) -> str | None:
    """What to say when a strategy ``kind`` names a server optimizer (None: it does not)."""
    if kind not in SERVER_OPTIMIZERS:
        return None
    return (
        f"{kind!r} is a server optimizer, not a strategy: set kind = 'fedavg' (or "
        f"'tiered', 'fedprox') and server_opt = {kind!r}"
    )


def build_strategy(
    name: str,
    params: Mapping[str, object],
    *,
    per_round: int,
    seed: int,
    clock: ClockMode,
    proxy_X: "np.ndarray | None" = None,
    rounds: int | None = None,
    architectures: "Architectures | None" = None,
) -> tuple[StreamingFedAvg, dict[str, float | str]]:
    """The strategy and the extra train config it needs (e.g. FedProx's mu, the arch).

    ``proxy_X`` is the server's unlabeled proxy set; kind ``distill`` needs it, and takes
    its tiers' architectures from ``architectures`` (default: the digits MLPs). When the
    train config carries ``"arch"``, the initial and evaluated model must be that arch.
    ``rounds``, when known (a job manifest), refuses central DP whose rounds would cost
    more than its ``privacy.epsilon``; ``start_rounds`` checks it again before training.
    """
    table = f"strategies.{name}"
    kind = str(params.get("kind", name))
    misnamed = optimizer_as_kind(kind)
    if misnamed:
        raise StrategyConfigError(f"{table}.kind: {misnamed}")
    if kind not in KINDS:
        raise StrategyConfigError(f"{table}.kind: unknown strategy {kind!r} (known: {KINDS})")
    allowed = dict(_DEADLINE) | _PRIVACY | _SERVER_OPT
    allowed |= {key: kind_ for key, (_, kind_) in _LOCAL_STEP.items()}
    if kind in TIERED_KINDS:
        allowed |= _TIERED
    if kind == "distill":
        allowed |= _DISTILL
    elif kind == "nested":
        allowed |= _NESTED
    else:
        allowed |= _ARCH
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
    privacy = _privacy(table, values.pop("privacy", {}), kind=kind, per_round=per_round)
    try:
        server_opt = ServerOptConfig.from_params(
            {k: values.pop(k) for k in list(values) if k in _SERVER_OPT}
        )
    except ValueError as exc:
        raise StrategyConfigError(f"{table}: {exc}") from None
    if server_opt is not None and kind == "nested":
        raise StrategyConfigError(
            f"{table}.server_opt: kind 'nested' has no server optimizer yet (a step on a "
            "mean that covers some parameters and not others is untried); use kind "
            "'tiered' with server_opt, or nested without it"
        )
    if server_opt is not None and kind == "distill":
        # Where FedOpt does not apply: distill re-makes each architecture's model by
        # ensemble distillation (FedDF), so no single pseudo-gradient exists per round.
        raise StrategyConfigError(
            f"{table}.server_opt: kind 'distill' cannot take a server optimizer (its "
            "models come from ensemble distillation, not one folded mean); use kind "
            "'tiered' with server_opt, or distill without it"
        )
    try:
        deadline = DeadlineConfig(**{k: values.pop(k) for k in list(values) if k in _DEADLINE})
        train_config: dict[str, float | str] = {}
        for key, (config_key, _) in _LOCAL_STEP.items():
            if key in values:
                if not values[key] > 0:
                    raise ValueError(f"{key} must be > 0, got {values[key]!r}")
                train_config[config_key] = values.pop(key)
        if "arch" in values:
            from fedge.models.digits import ARCHITECTURES  # torch: only when asked for

            if values["arch"] not in ARCHITECTURES:
                raise ValueError(
                    f"arch: unknown architecture {values['arch']!r} "
                    f"(known: {sorted(ARCHITECTURES)})"
                )
            train_config["arch"] = values.pop("arch")
        if kind == "fedprox":
            train_config["proximal-mu"] = values.pop("proximal_mu", 0.01)
        if kind in TIERED_KINDS and "tiers" in values:
            values["n_tiers"] = values.pop("tiers")
        if kind in TIER_ARCH_KINDS:
            # The training stack (torch) is imported only for these kinds.
            from fedge.aggregator.strategies.architectures import TieredArchitectures
            from fedge.aggregator.strategies.feddf import DistillingTieredFedAvg
            from fedge.aggregator.strategies.nested import NestedTieredFedAvg
            from fedge.models.architectures import DIGITS

            if kind == "distill":
                if proxy_X is None:
                    raise ValueError("distill needs the server's unlabeled proxy set (proxy_X)")
                values["proxy_X"] = proxy_X
            elif "tier_archs" not in values:  # distill has a default; nested's must nest
                raise ValueError(
                    "tier_archs: nested needs one architecture per tier, fastest first, "
                    "each a slice of the largest"
                )
            cls: type[TieredArchitectures] = (
                DistillingTieredFedAvg if kind == "distill" else NestedTieredFedAvg
            )
            per_tier = cls(
                per_round=per_round,
                seed=seed,
                clock=clock,
                deadline=deadline,
                architectures=DIGITS if architectures is None else architectures,
                **values,
            )
            train_config["arch"] = per_tier.evaluation_arch
            strategy: StreamingFedAvg = per_tier
        elif kind == "tiered":
            strategy = TieredFedAvg(
                per_round=per_round,
                seed=seed,
                clock=clock,
                deadline=deadline,
                server_opt=server_opt,
                **values,
            )
        else:
            strategy = StreamingFedAvg(
                per_round=per_round,
                seed=seed,
                clock=clock,
                deadline=deadline,
                server_opt=server_opt,
            )
    except (ValueError, TypeError) as exc:
        raise StrategyConfigError(f"{table}: {exc}") from None
    strategy.privacy = privacy
    if privacy.mode is PrivacyMode.CENTRAL:
        try:
            central_dp.check_strategy(strategy)
            if rounds is not None:
                central_dp.check_rounds(privacy, rounds)
        except PrivacyError as exc:
            raise StrategyConfigError(f"{table}: {exc}") from None
    return strategy, train_config


def _privacy(table: str, values: dict[str, object], *, kind: str, per_round: int) -> PrivacySpec:
    """The strategy's privacy table, validated before anything trains."""
    try:
        spec = PrivacySpec.from_table(values)
        spec.check_parties(per_round)
    except PrivacyError as exc:
        raise StrategyConfigError(f"{table}: {exc}") from None
    if spec.mode is PrivacyMode.LOCAL and kind == "fedprox":
        # FedProx's proximal term is not a per-sample loss: DP-SGD's clipping cannot bound it.
        raise StrategyConfigError(f"{table}.privacy: mode 'local' (DP-SGD) cannot train FedProx")
    if spec.secagg and spec.mode is PrivacyMode.CENTRAL:
        raise StrategyConfigError(
            f"{table}.privacy: SecAgg+ with central DP is not supported (the server never "
            "sees an update to clip); use mode 'local' (DP-SGD) with SecAgg+"
        )
    if spec.secagg and kind in TIER_ARCH_KINDS:
        raise StrategyConfigError(
            f"{table}.privacy: SecAgg+ yields one aggregate per round; {kind} folds one "
            "model per tier architecture"
        )
    if spec.mode is PrivacyMode.CENTRAL and kind in TIER_ARCH_KINDS:
        raise StrategyConfigError(
            f"{table}.privacy: mode 'central' clips one model's updates; {kind} trains one "
            "model per tier architecture"
        )
    return spec

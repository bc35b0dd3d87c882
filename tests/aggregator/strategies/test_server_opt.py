"""Server optimizers (FedOpt, issue 29): the step against a reference written out in NumPy,
purity, bad hyper-parameters refused where strategies are built."""

from __future__ import annotations

import numpy as np
import pytest

from fedge.aggregator.fleet.manifest import parse_fleet_manifest
from fedge.aggregator.jobs.spec import ManifestError
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.strategies.factory import StrategyConfigError, build_strategy
from fedge.aggregator.strategies.server_opt import (
    ServerOptConfig,
    ServerOptState,
    server_step,
)
from fedge.sim.server_app import ServerSettings

ROUNDS = 4


def _rounds() -> tuple[dict[str, np.ndarray], list[dict[str, np.ndarray]]]:
    """A float64 model and four rounds of folded means around it (given pseudo-gradients)."""
    rng = np.random.default_rng(7)
    x0 = {"w": rng.standard_normal((3, 4)), "b": rng.standard_normal(4)}
    grads = [{k: rng.standard_normal(v.shape) * 0.1 for k, v in x0.items()} for _ in range(ROUNDS)]
    return x0, grads


def _reference(
    name: str, lr: float, beta1: float, beta2: float, tau: float
) -> list[dict[str, np.ndarray]]:
    """Reddi et al. (ICLR'21) Algorithm 2 and Hsu et al. (2019) FedAvgM, written out with
    Delta = mean - x (the paper's sign); v starts at tau^2, m at 0, no bias correction."""
    x0, grads = _rounds()
    x = {k: v.copy() for k, v in x0.items()}
    m = {k: np.zeros_like(v) for k, v in x0.items()}
    v = {k: np.full_like(a, tau**2) for k, a in x0.items()}
    models = []
    for g in grads:
        for k in x:
            delta = -g[k]
            if name == "fedavgm":
                m[k] = beta1 * m[k] + delta
                x[k] = x[k] + lr * m[k]
                continue
            m[k] = beta1 * m[k] + (1 - beta1) * delta
            if name == "fedadagrad":
                v[k] = v[k] + delta**2
            elif name == "fedadam":
                v[k] = beta2 * v[k] + (1 - beta2) * delta**2
            else:
                v[k] = v[k] - (1 - beta2) * delta**2 * np.sign(v[k] - delta**2)
            x[k] = x[k] + lr * m[k] / (np.sqrt(v[k]) + tau)
        models.append({k: a.copy() for k, a in x.items()})
    return models


@pytest.mark.parametrize("name", ["fedadam", "fedyogi", "fedadagrad", "fedavgm"])
def test_the_server_step_equals_the_reference_written_out_in_numpy(name: str) -> None:
    lr, beta1, beta2, tau = 0.05, 0.9, 0.99, 1e-3
    config = (
        ServerOptConfig(name, lr, beta1=beta1)
        if name == "fedavgm"
        else ServerOptConfig(name, lr, beta1=beta1, beta2=beta2, tau=tau)
    )
    expected = _reference(name, lr, beta1, beta2, tau)
    x, grads = _rounds()
    state = ServerOptState()
    for index, g in enumerate(grads):
        mean = {k: x[k] - g[k] for k in x}  # the round's fold: pseudo-gradient g = x - mean
        x, state = server_step(config, state, x, mean)
        assert state.step == index + 1
        for key in x:
            np.testing.assert_allclose(x[key], expected[index][key], rtol=0, atol=1e-7)


def test_the_step_is_pure_and_counters_take_the_mean() -> None:
    x: dict[str, np.ndarray] = {"w": np.ones(3, np.float32), "count": np.array(4, np.int64)}
    mean: dict[str, np.ndarray] = {
        "w": np.full(3, 2.0, np.float32),
        "count": np.array(6, np.int64),
    }
    before = {k: v.copy() for k, v in x.items()}
    state = ServerOptState()
    new, after = server_step(ServerOptConfig("fedadam", 0.1), state, x, mean)
    assert all(np.array_equal(x[k], before[k]) for k in x)  # inputs untouched
    assert state.step == 0 and not state.m  # the old state too
    assert new["count"] == 6 and new["count"].dtype == np.int64  # no step on a counter
    assert new["w"].dtype == np.float32 and after.m["w"].dtype == np.float32
    assert set(after.m) == {"w"} and np.all(new["w"] > 1)  # a step towards the mean


def test_server_momentum_without_momentum_at_step_one_is_fedavg() -> None:
    x = {"w": np.array([0.5, -1.0])}
    mean = {"w": np.array([0.25, 3.0])}
    new, _ = server_step(ServerOptConfig("fedavgm", 1.0, beta1=0.0), ServerOptState(), x, mean)
    np.testing.assert_array_equal(new["w"], mean["w"])


def test_a_mean_of_another_model_is_refused() -> None:
    x = {"w": np.zeros(3)}
    with pytest.raises(ValueError, match="'w'"):
        server_step(ServerOptConfig("fedadam", 0.1), ServerOptState(), x, {"w": np.zeros(4)})
    with pytest.raises(ValueError, match="arrays"):
        server_step(ServerOptConfig("fedadam", 0.1), ServerOptState(), x, {"v": np.zeros(3)})


def _build(kind: str, **params: object) -> None:
    build_strategy(
        "s", {"kind": kind, **params}, per_round=3, seed=0, clock=ClockMode.VIRTUAL,
        proxy_X=np.zeros((4, 64), np.float32),
    )  # fmt: skip


@pytest.mark.parametrize(
    ("params", "says"),
    [
        ({"server_opt": "fedadam", "server_lr": 0.0}, "server_lr must be a number > 0"),
        ({"server_opt": "fedadam", "server_lr": -0.1}, "server_lr must be a number > 0"),
        ({"server_opt": "fedyogi", "beta1": 1.0}, r"beta1 must be in \[0, 1\)"),
        ({"server_opt": "fedadam", "beta2": -0.1}, r"beta2 must be in \[0, 1\)"),
        ({"server_opt": "fedadagrad", "tau": 0}, "tau must be a number > 0"),
        ({"server_opt": "adam"}, "unknown server optimizer 'adam'"),
        ({"server_lr": 0.1}, "server_lr set without server_opt"),
        ({"server_opt": "fedavgm", "beta2": 0.9}, "'fedavgm' .* has no beta2"),
        ({"server_opt": 3}, "server_opt: expected str"),
    ],
)
def test_bad_server_optimizer_settings_are_refused_naming_the_key(
    params: dict[str, object], says: str
) -> None:
    with pytest.raises(StrategyConfigError, match=says):
        _build("tiered", **params)


def test_an_optimizer_is_refused_where_it_cannot_serve() -> None:
    with pytest.raises(StrategyConfigError, match="'distill' cannot take a server optimizer"):
        _build("distill", server_opt="fedadam", tiers=2, tier_archs=["mlp", "mlp-small"])
    with pytest.raises(StrategyConfigError, match="is a server optimizer, not a strategy"):
        _build("fedadam")


@pytest.mark.parametrize("kind", ["fedavg", "fedprox", "tiered"])
def test_every_kind_but_distill_takes_a_server_optimizer(kind: str) -> None:
    strategy, _ = build_strategy(
        "s",
        {"kind": kind, "server_opt": "fedyogi", "server_lr": 0.02, "tau": 1e-2,
         "late_policy": "stale", "quorum_fraction": 0.6},
        per_round=3, seed=0, clock=ClockMode.VIRTUAL,
    )  # fmt: skip
    assert strategy.server_opt == ServerOptConfig("fedyogi", 0.02, tau=1e-2)
    assert strategy.state_dict()["server_opt"] == {"name": "fedyogi", "step": 0}


FLEET_MANIFEST = """
[job]
name = "opt"
rounds = 2
[task]
model = "inspect:1"
[strategy]
kind = "tiered"
[strategy.params]
tiers = 2
late_policy = "stale"
SERVER_OPT
[federation]
backend = "fleet"
fleet = "plant-a"
edges = ["st-01", "st-02", "st-03", "st-04"]
"""


def test_a_fleet_manifest_carries_its_server_optimizer_or_is_refused_at_load() -> None:
    good = FLEET_MANIFEST.replace("SERVER_OPT", 'server_opt = "fedadam"\nserver_lr = 0.03')
    params = parse_fleet_manifest(good).strategy_params()
    assert (params["server_opt"], params["server_lr"]) == ("fedadam", 0.03)
    for bad, says in [
        ('server_opt = "fedadam"\nserver_lr = -1', "strategy.params: server_lr must be"),
        ('server_opt = "fedyogi"\nbeta1 = 1.5', r"strategy.params: beta1 must be in \[0, 1\)"),
        ('server_opt = "fedadam"\ntau = 0.0', "strategy.params: tau must be a number > 0"),
    ]:
        with pytest.raises(ManifestError, match=says):
            parse_fleet_manifest(FLEET_MANIFEST.replace("SERVER_OPT", bad))
    as_kind = good.replace('kind = "tiered"', 'kind = "fedyogi"')
    with pytest.raises(ManifestError, match="'fedyogi' is a server optimizer, not a strategy"):
        parse_fleet_manifest(as_kind)


def test_the_server_apps_run_config_carries_the_server_optimizer() -> None:
    config: dict[str, bool | int | float | str] = {
        "strategy": "tiered", "scenario": "s.toml", "seed": 1, "run-store": "runs.db",
        "server-opt": "fedyogi", "server-lr": 0.02, "beta1": 0.8, "tau": 0.01,
    }  # fmt: skip
    params = ServerSettings.from_run_config(config).strategy_params
    assert {k: params[k] for k in ("server_opt", "server_lr", "beta1", "tau")} == {
        "server_opt": "fedyogi", "server_lr": 0.02, "beta1": 0.8, "tau": 0.01,
    }  # fmt: skip
    momentum = {**config, "server-opt": "fedavgm", "server-lr": 0.0, "beta2": 0.99}
    assert ServerSettings.from_run_config(momentum).strategy_params == {
        "server_opt": "fedavgm", "beta1": 0.8,
    }  # fmt: skip
    # "" is Flower's way to say "none" (a run config has no unset): its keys are ignored.
    off = ServerSettings.from_run_config({**config, "server-opt": ""}).strategy_params
    assert not set(off) & {"server_opt", "server_lr", "beta1", "tau"}

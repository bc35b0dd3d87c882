"""Accounting: the epsilon a party reports is Opacus' own, and plans land on their target."""

import ast
import inspect
import math

import numpy as np
import pytest
import torch
from opacus.accountants import PRVAccountant, RDPAccountant
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from torch import nn

from fedge.party.dp_sgd import train_private
from fedge.privacy import accounting
from fedge.privacy.accounting import (
    OPACUS_ALPHAS,
    RDP_ORDERS,
    _planned_noise,
    epsilon_spent,
    plan_round,
)
from fedge.privacy.settings import DpRelease, PrivacyError, PrivacyMode, PrivacySpec

DELTA = 1e-3


def _trained_release(seed: int = 0) -> DpRelease:
    rng = np.random.default_rng(seed)
    x = rng.normal(size=(300, 6)).astype(np.float32)
    y = (x[:, 0] > 0).astype(np.int64)
    torch.manual_seed(seed)
    model = nn.Sequential(nn.Linear(6, 8), nn.ReLU(), nn.Linear(8, 2))
    training = train_private(
        model, x, y, epochs=3, lr=0.1, batch_size=30, noise_multiplier=1.1,
        clipping_norm=1.0, seed=seed,
    )  # fmt: skip
    return training.release


def _independent_rdp(history: list[DpRelease], delta: float) -> float:
    """Opacus' RDP analysis functions on its default orders: not our code path."""
    orders = RDPAccountant.DEFAULT_ALPHAS
    rdp = sum(
        compute_rdp(
            q=r.sample_rate, noise_multiplier=r.noise_multiplier, steps=r.steps, orders=orders
        )
        for r in history
    )
    epsilon, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=delta)
    return float(epsilon)


@pytest.mark.slow
def test_the_reported_epsilon_is_opacus_rdp_analysis_of_what_was_trained() -> None:
    release = _trained_release()
    # 300 examples in batches of 30: Opacus samples at 1/10 and steps 10 times an epoch.
    assert release == DpRelease(noise_multiplier=1.1, sample_rate=0.1, steps=30)
    reported = epsilon_spent([release], DELTA, "rdp")
    assert reported == pytest.approx(_independent_rdp([release], DELTA), rel=1e-12)
    assert 0.5 < reported < 5
    # Three rounds of a job compose (RDP adds up), again as Opacus' analysis says.
    other = DpRelease(noise_multiplier=0.9, sample_rate=0.05, steps=40)
    history = [release, other, release]
    assert epsilon_spent(history, DELTA) == pytest.approx(
        _independent_rdp(history, DELTA), rel=1e-12
    )
    # And what Opacus' RDPAccountant reports for that history on our (wider) orders.
    accountant = RDPAccountant()
    accountant.history = [(r.noise_multiplier, r.sample_rate, r.steps) for r in history]
    assert epsilon_spent(history, DELTA) == pytest.approx(
        accountant.get_epsilon(delta=DELTA, alphas=list(RDP_ORDERS)), rel=1e-12
    )


def test_strong_privacy_is_reported_tighter_than_opacus_default_orders_allow() -> None:
    # sigma 50 on the whole data set once: the best of Opacus' default orders is its
    # largest (63), and Opacus says so; our wider orders tighten the bound.
    release = DpRelease(noise_multiplier=50.0, sample_rate=1.0, steps=1)
    with pytest.warns(UserWarning, match="largest alpha"):
        default = _independent_rdp([release], DELTA)
    assert 0 < epsilon_spent([release], DELTA) < default * 0.9


@pytest.mark.slow
def test_the_reported_epsilon_is_opacus_prv_accountant_fed_step_by_step() -> None:
    release = _trained_release(seed=1)
    other = DpRelease(noise_multiplier=0.8, sample_rate=0.2, steps=7)
    independent = PRVAccountant()
    for entry in (release, other, release):  # as Opacus' optimizer hook feeds it
        for _ in range(entry.steps):
            independent.step(noise_multiplier=entry.noise_multiplier, sample_rate=entry.sample_rate)
    expected = independent.get_epsilon(delta=DELTA)
    assert epsilon_spent([release, other, release], DELTA, "prv") == pytest.approx(
        expected, rel=1e-9
    )
    # PRV is tighter than RDP for the same history.
    assert expected < epsilon_spent([release, other, release], DELTA, "rdp")


@pytest.mark.parametrize("accountant", ["rdp", "prv"])
@pytest.mark.slow
def test_a_planned_job_spends_its_target_and_never_more(accountant: str) -> None:
    spec = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=4.0, delta=DELTA, accountant=accountant)  # type: ignore[arg-type]
    release = plan_round(spec, examples=250, batch_size=32, epochs=2, planned_rounds=4)
    assert release.sample_rate == pytest.approx(1 / 8)  # ceil(250 / 32) = 8 batches
    assert release.steps == 16
    spent = epsilon_spent([release] * 4, DELTA, accountant)
    # Opacus' search stops within 0.01 below the target.
    assert 4.0 - 0.01 <= spent <= 4.0 * (1 + 1e-9)
    assert epsilon_spent([release] * 5, DELTA, accountant) > 4.0


@pytest.mark.slow
def test_planning_is_cached_and_a_fixed_sigma_is_only_accounted() -> None:
    spec = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=6.0, delta=DELTA)
    before = _planned_noise.cache_info().hits
    first = plan_round(spec, examples=500, batch_size=50, epochs=1, planned_rounds=10)
    second = plan_round(spec, examples=500, batch_size=50, epochs=1, planned_rounds=10)
    assert first == second
    assert _planned_noise.cache_info().hits >= before + 1
    fixed = PrivacySpec(mode=PrivacyMode.LOCAL, noise_multiplier=1.0)
    assert plan_round(fixed, examples=100, batch_size=400, epochs=3, planned_rounds=9) == (
        DpRelease(noise_multiplier=1.0, sample_rate=1.0, steps=3)  # a batch over all: q = 1
    )
    # More data at the same batch size: a lower rate, so less noise for the same target.
    more = plan_round(spec, examples=5000, batch_size=50, epochs=1, planned_rounds=10)
    assert more.sample_rate == pytest.approx(0.01)
    assert more.noise_multiplier < first.noise_multiplier


@pytest.mark.parametrize(
    ("field", "value"),
    [("examples", 0), ("batch_size", 0), ("epochs", 0), ("planned_rounds", 0), ("epochs", -2)],
)
def test_planning_refuses_nonsense_sizes(field: str, value: int) -> None:
    sizes = {"examples": 100, "batch_size": 10, "epochs": 1, "planned_rounds": 3, field: value}
    spec = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=8.0)
    with pytest.raises(PrivacyError, match=f"{field} >= 1"):
        plan_round(spec, **sizes)


def test_an_unreachable_target_is_a_clear_error() -> None:
    spec = PrivacySpec(mode=PrivacyMode.LOCAL, epsilon=1e-6, delta=1e-9)
    with pytest.raises(PrivacyError, match=r"no noise multiplier reaches epsilon = 1e-06"):
        plan_round(spec, examples=10, batch_size=10, epochs=100, planned_rounds=100)


def test_a_spec_with_neither_target_nor_sigma_cannot_plan() -> None:
    with pytest.raises(PrivacyError, match=r"target privacy\.epsilon or a fixed"):
        plan_round(PrivacySpec(), examples=10, batch_size=2, epochs=1, planned_rounds=1)


def test_nothing_released_is_nothing_spent_and_inputs_are_checked() -> None:
    assert epsilon_spent([], DELTA) == 0.0
    assert epsilon_spent([DpRelease(1.0, 0.1, 0)], DELTA, "prv") == 0.0
    with pytest.raises(PrivacyError, match=r"delta must be in \(0, 1\)"):
        epsilon_spent([DpRelease(1.0, 0.1, 3)], 1.0)
    with pytest.raises(PrivacyError, match="accountant must be one of"):
        epsilon_spent([DpRelease(1.0, 0.1, 3)], DELTA, "gdp")
    for sigma, q, steps in [(0.0, 0.1, 1), (math.nan, 0.1, 1), (1.0, 0.0, 1), (1.0, 1.5, 1)]:
        with pytest.raises(PrivacyError, match="a DP release's"):
            DpRelease(sigma, q, steps)
    with pytest.raises(PrivacyError, match="steps must be an integer >= 0"):
        DpRelease(1.0, 0.1, -1)


def test_prv_where_privacy_is_long_gone_answers_with_the_rdp_bound() -> None:
    # PRV's discretisation fails for tiny noise and takes minutes for weak privacy; the
    # RDP bound holds for the same mechanism.
    tiny = DpRelease(noise_multiplier=0.01, sample_rate=0.1, steps=5)
    assert epsilon_spent([tiny], DELTA, "prv") == epsilon_spent([tiny], DELTA, "rdp") > 1000
    weak = DpRelease(noise_multiplier=0.3, sample_rate=0.5, steps=1000)
    assert epsilon_spent([weak], DELTA, "prv") == epsilon_spent([weak], DELTA, "rdp")


def test_the_written_out_orders_are_opacus_own_and_importing_needs_no_opacus() -> None:
    assert list(OPACUS_ALPHAS) == RDPAccountant.DEFAULT_ALPHAS
    assert RDP_ORDERS[: len(OPACUS_ALPHAS)] == OPACUS_ALPHAS
    top_level = ast.parse(inspect.getsource(accounting)).body
    imported = [
        node.module if isinstance(node, ast.ImportFrom) else node.names[0].name
        for node in top_level
        if isinstance(node, ast.Import | ast.ImportFrom)
    ]
    assert not [m for m in imported if m and m.split(".")[0] in ("opacus", "torch")], imported

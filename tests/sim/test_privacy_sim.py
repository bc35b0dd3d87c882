"""Privacy in simulated federations: DP-SGD parties, budgets, central DP, and bad settings.

Runs the real party ClientApp (Opacus DP-SGD, SQLite ledgers) on the in-process grid, and
jobs through ``run_job``/``resume_job`` with their run store.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np
import pytest
from opacus.accountants.analysis.rdp import compute_rdp, get_privacy_spent
from typer.testing import CliRunner

from fedge.aggregator.jobs.control import halt_job, job_status
from fedge.aggregator.jobs.directory import LEDGERS, RUNS_DB
from fedge.aggregator.jobs.run_store import RunState, RunStore
from fedge.aggregator.jobs.spec import ManifestError
from fedge.aggregator.privacy.central_dp import CentralDP, station_epsilon
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.strategies.factory import StrategyConfigError, build_strategy
from fedge.cli.main import app
from fedge.party.budget import BudgetLedger
from fedge.privacy.settings import PrivacyMode, PrivacySpec
from fedge.sim import runner
from fedge.sim.job_manifest import parse_manifest
from fedge.sim.jobs import resume_job, run_job
from fedge.sim.scenario import load_scenario, parse_scenario

SCENARIO = """
name = "tiny-dp"
[data]
dataset = "inspection"
alpha = 1.0
[fleet]
parties = 4
per_round = 2
[[fleet.groups]]
count = 2
cpus = 4.0
data_share = 0.5
[[fleet.groups]]
count = 2
cpus = 1.0
data_share = 0.5
[device]
seconds_per_example = 0.002
[training]
rounds = 5
lr = 0.05
local_epochs = 1
batch_size = 64
target_accuracy = 0.8

[strategies.tiered]
tiers = 2
profiling_rounds = 1
adaptive = false

[strategies.tiered-dp]
kind = "tiered"
tiers = 2
profiling_rounds = 1
adaptive = false
[strategies.tiered-dp.privacy]
mode = "local"
epsilon = 4.0
delta = 1e-3
clipping_norm = 1.0
rounds_per_party = 2

[strategies.secagg-dp]
kind = "tiered"
tiers = 2
profiling_rounds = 1
adaptive = false
[strategies.secagg-dp.privacy]
mode = "local"
epsilon = 4.0
rounds_per_party = 5
secagg = true
secagg_threshold = 3

[strategies.central]
kind = "tiered"
tiers = 2
profiling_rounds = 1
adaptive = false
[strategies.central.privacy]
mode = "central"
noise_multiplier = 1.0
clipping_norm = 0.5
"""


@pytest.fixture(scope="module")
def scenario(tmp_path_factory: pytest.TempPathFactory) -> object:
    """Parties load their scenario by path (as Flower's runtimes give it to them)."""
    path = tmp_path_factory.mktemp("scenario") / "tiny-dp.toml"
    path.write_text(SCENARIO)
    return load_scenario(str(path))


@pytest.mark.slow
def test_dp_sgd_parties_stay_within_their_target_and_run_out_cleanly(scenario: object) -> None:
    """Each party plans its noise for 2 rounds at eps 4; asked a third time it refuses, the
    strategy stops asking it, and the run ends (no hang) once nobody can train."""
    curve = runner.run_one(scenario, "tiered-dp", seed=0)  # type: ignore[arg-type]
    assert curve.epsilon and curve.epsilon[0] == 0.0
    assert max(curve.epsilon) <= 4.0 + 1e-6
    assert curve.epsilon == tuple(sorted(curve.epsilon))  # spent only grows
    # Profiling asks all 4 (round 1), then 2 per round: every party trains at most twice.
    trained: dict[int, int] = {}
    refused: set[int] = set()
    for record in curve.rounds:
        for node in record.on_time:
            trained[node] = trained.get(node, 0) + 1
        for node, why in record.failures.items():
            assert "BudgetExhaustedError" in why, why
            refused.add(node)
    assert trained and max(trained.values()) <= 2
    assert refused  # seed 0 draws one tier three times in rounds 2-5
    assert len(curve.rounds) <= 5
    # An exhausted party is asked at most once more (the round it refused), never again.
    for node in refused:
        asked = [r.server_round for r in curve.rounds if node in r.selected]
        refusals = [r.server_round for r in curve.rounds if node in r.failures]
        assert refusals == [max(asked)]
    assert 0.3 < curve.final_accuracy <= 1.0


@pytest.mark.slow
def test_the_reported_epsilon_matches_opacus_for_the_recorded_steps(tmp_path: Path) -> None:
    """What a simulated party reports equals Opacus' RDP analysis of its ledger's steps."""
    text = SCENARIO.replace("rounds = 5", "rounds = 2")
    scenario = parse_scenario(text, source="tiny-dp")
    job = tmp_path / "job"
    (tmp_path / "scenario.toml").write_text(text)
    (tmp_path / "job.toml").write_text(
        """
[job]
name = "dp-job"
rounds = 2
seed = 1
[task]
scenario = "scenario.toml"
[strategy]
kind = "tiered"
[strategy.params]
tiers = 2
profiling_rounds = 1
adaptive = false
[privacy]
mode = "local"
epsilon = 4.0
delta = 1e-3
rounds_per_party = 2
"""
    )
    assert scenario.fleet.parties == 4
    run_job(tmp_path / "job.toml", job)
    store = RunStore(job / RUNS_DB)
    try:
        (run,) = store.runs()
        spent = store.privacy_spent(run["run_id"])
        metrics = store.party_metrics(run["run_id"])
    finally:
        store.close()
    assert spent and all(row["rounds"] >= 1 for row in spent)
    orders = [1 + x / 10.0 for x in range(1, 100)] + list(range(12, 64))
    for row in metrics:
        m = row["metrics"]
        party = int(row["party"]) - min(int(r["party"]) for r in metrics)
        assert m["dp-epsilon-round"] > 0
        ledger = BudgetLedger(job / LEDGERS / f"party-{party}.db")
        try:
            history = ledger.history(None)
        finally:
            ledger.close()
        rdp = sum(
            compute_rdp(
                q=h.sample_rate, noise_multiplier=h.noise_multiplier, steps=h.steps, orders=orders
            )
            for h in history
        )
        eps, _ = get_privacy_spent(orders=orders, rdp=rdp, delta=1e-3)
        latest = max(r["round"] for r in metrics if r["party"] == row["party"])
        if row["round"] == latest:
            assert m["dp-epsilon-job"] == pytest.approx(eps, rel=0.02)
    (status,) = job_status(job)
    assert [r["rounds"] for r in status.privacy] and status.privacy[0]["epsilon_job"] > 0
    shown = CliRunner().invoke(app, ["aggregator", "status", "--dir", str(job)])
    assert shown.exit_code == 0, shown.output
    assert "privacy spent" in shown.output
    first = status.privacy[0]
    assert f"{first['epsilon_job']:.3f}" in shown.output


def three_per_round(scenario: object) -> object:
    """The scenario asking 3 parties a round: SecAgg+ never runs with fewer (issue 24)."""
    import dataclasses as dc

    from fedge.sim.scenario import Scenario

    assert isinstance(scenario, Scenario)
    return dc.replace(scenario, fleet=dc.replace(scenario.fleet, per_round=3))


@pytest.mark.slow
def test_secagg_with_dp_sgd_runs_tiered_rounds_on_the_simulated_fleet(scenario: object) -> None:
    """SecAgg+ over DP-SGD parties: every round asks the tier TiFL chose, the parties'
    epsilon is reported (metrics are not masked, only the model), the model learns. Two
    tiers asked of 4 parties: under SecAgg+ a tier holds at least 3, so there is one."""
    curve = runner.run_one(three_per_round(scenario), "secagg-dp", seed=0)  # type: ignore[arg-type]
    assert len(curve.rounds) == 5
    assert curve.rounds[0].tier is None and len(curve.rounds[0].on_time) == 4  # profiling
    for record in curve.rounds[1:]:
        assert record.tier == 0 and len(record.on_time) == 3, record
    assert 0 < curve.epsilon[-1] <= 4.0 + 1e-6
    assert curve.final_accuracy > 0.5


@pytest.mark.slow
def test_secagg_carries_on_and_stops_cleanly_as_parties_run_out_of_budget(
    scenario: object,
) -> None:
    """2 planned rounds per party, 7 rounds: tiers shrink below SecAgg+'s threshold and
    parties refuse mid-protocol; those rounds are lost (recorded, not raised) and the run
    stops once nobody can train, instead of failing the job."""
    import dataclasses as dc

    from fedge.sim.scenario import Scenario

    assert isinstance(scenario, Scenario)
    table = dict(scenario.strategy("secagg-dp"))
    privacy = table["privacy"]
    assert isinstance(privacy, dict)
    table["privacy"] = {**privacy, "rounds_per_party": 2}
    three = three_per_round(scenario)
    assert isinstance(three, Scenario)
    short = dc.replace(
        three.with_rounds(7), strategies={**scenario.strategies, "secagg-short": table}
    )
    curve = runner.run_one(short, "secagg-short", seed=0)
    assert 1 <= len(curve.rounds) <= 7
    refusals = [why for r in curve.rounds for why in r.failures.values()]
    assert refusals and all("Budget" in why or "SecAgg+" in why for why in refusals), refusals
    assert max(curve.epsilon) <= 4.0 + 1e-6


def test_central_dp_clips_noises_and_accounts_every_released_round(scenario: object) -> None:
    curve = runner.run_one(scenario, "central", seed=0)  # type: ignore[arg-type]
    strategy, _ = build_strategy(
        "central",
        scenario.strategy("central"),  # type: ignore[attr-defined]
        per_round=2,
        seed=0,
        clock=ClockMode.VIRTUAL,
    )
    spec = strategy.privacy
    assert spec.mode is PrivacyMode.CENTRAL
    # Every round released (no party failed): epsilon after r rounds is the Gaussian
    # mechanism's composed r times, no sampling amplification.
    assert len(curve.rounds) == 5
    assert curve.epsilon[1:] == tuple(station_epsilon(spec, r) for r in range(1, 6))
    assert curve.epsilon[-1] > curve.epsilon[1] > 0


def test_central_dp_adds_noise_sized_for_the_round(scenario: object) -> None:
    """Same seed, same replies: the wrapper's model differs from the plain one by noise of
    about sigma * C / n, not by more (clipping keeps it bounded)."""
    from fedge.sim.data import make_partitions
    from fedge.sim.grid import InProcessGrid
    from fedge.sim.party_app import app

    strategy, _ = build_strategy(
        "central",
        scenario.strategy("central"),  # type: ignore[attr-defined]
        per_round=2,
        seed=0,
        clock=ClockMode.VIRTUAL,
    )
    wrapper = CentralDP(strategy)
    data = make_partitions(scenario, 0)  # type: ignore[arg-type]
    assert data.num_parties == 4
    config = runner.run_config(scenario, 0)  # type: ignore[arg-type]
    grid = InProcessGrid(app, 4, run_config=config)
    try:
        from fedge.models import digits

        initial = digits.to_arrays(digits.make_model("mlp", seed=0))
        result = wrapper.start(grid, initial, num_rounds=1, timeout=60)
    finally:
        grid.close()
    assert wrapper.num_sampled_clients == 4  # the profiling round asked everyone
    moved = np.concatenate(
        [(result.arrays[k].numpy() - initial[k].numpy()).ravel() for k in initial]
    )
    # Each update is clipped to 0.5 and averaged, then noise of std 1.0 * 0.5 / 4 added.
    assert 0.5 * 0.125 * np.sqrt(moved.size) < np.linalg.norm(moved)
    assert np.linalg.norm(moved) < 0.5 + 3 * 0.125 * np.sqrt(moved.size)


@pytest.mark.parametrize(
    ("privacy", "message"),
    [
        ('mode = "local"\nepsilon = 0.0', "epsilon must be > 0"),
        ('mode = "local"\nepsilon = 8.0\ndelta = 1.0', "delta must be in (0, 1)"),
        ('mode = "local"\nepsilon = 8.0\nclipping_norm = 0.0', "clipping_norm must be > 0"),
        ('mode = "local"', "needs a target privacy.epsilon"),
        ('mode = "central"', "needs privacy.noise_multiplier"),
        ('mode = "local"\nepsilon = 8.0\nsecagg = true\nsecagg_threshold = 2', "count >= 3"),
        ('mode = "local"\nepsilon = 8.0\nsecagg = true', "at least 3 parties per round"),
        ('mode = "sideways"', "privacy.mode"),
        ('mode = "local"\nepsilon = 8.0\nepsilom = 2.0', "unknown field 'privacy.epsilom'"),
    ],
)
def test_bad_privacy_settings_fail_before_any_training(
    tmp_path: Path, privacy: str, message: str
) -> None:
    text = SCENARIO + f'\n[strategies.bad]\nkind = "tiered"\n[strategies.bad.privacy]\n{privacy}\n'
    scenario = parse_scenario(text, source="bad")
    with pytest.raises(StrategyConfigError, match=message.replace("(", r"\(").replace(")", r"\)")):
        build_strategy(
            "bad", scenario.strategy("bad"), per_round=2, seed=0, clock=ClockMode.VIRTUAL
        )


def test_privacy_that_cannot_compose_with_the_strategy_is_refused() -> None:
    scenario = parse_scenario(
        SCENARIO
        + '\n[strategies.prox]\nkind = "fedprox"\n[strategies.prox.privacy]\nmode = "local"\n'
        "epsilon = 8.0\n" + '\n[strategies.late]\nkind = "tiered"\ndeadline_factor = 1.5\n'
        '[strategies.late.privacy]\nmode = "central"\nnoise_multiplier = 1.0\n',
        source="bad",
    )
    with pytest.raises(StrategyConfigError, match="cannot train FedProx"):
        build_strategy(
            "prox", scenario.strategy("prox"), per_round=2, seed=0, clock=ClockMode.VIRTUAL
        )
    with pytest.raises(StrategyConfigError, match="remove deadline_factor"):
        build_strategy(
            "late", scenario.strategy("late"), per_round=2, seed=0, clock=ClockMode.VIRTUAL
        )


def test_a_manifest_gives_privacy_once(tmp_path: Path) -> None:
    (tmp_path / "scenario.toml").write_text(SCENARIO)
    text = """
[job]
name = "twice"
rounds = 2
seed = 0
[task]
scenario = "scenario.toml"
[strategy]
kind = "tiered"
[strategy.params.privacy]
mode = "local"
epsilon = 8.0
[privacy]
mode = "local"
epsilon = 8.0
"""
    with pytest.raises(ManifestError, match="give the privacy settings once"):
        parse_manifest(text, source="twice", base_dir=tmp_path)
    bad = text.replace('[strategy.params.privacy]\nmode = "local"\nepsilon = 8.0\n', "")
    bad = bad.replace("epsilon = 8.0\n", "epsilon = -1.0\n")
    with pytest.raises(ManifestError, match="epsilon must be > 0"):
        parse_manifest(bad, source="bad", base_dir=tmp_path)


def _job(folder: Path, privacy: str, *, rounds: int, params: str = "") -> Path:
    """A simulated job on the tiny-dp scenario (its parties run DP-SGD for real)."""
    (folder / "scenario.toml").write_text(SCENARIO)
    manifest = folder / "job.toml"
    manifest.write_text(
        f"""
[job]
name = "dp-job"
rounds = {rounds}
seed = 0
[task]
scenario = "scenario.toml"
[strategy]
kind = "tiered"
[strategy.params]
tiers = 2
profiling_rounds = 1
adaptive = false
{params}
[privacy]
{privacy}
"""
    )
    return manifest


def test_a_party_out_of_budget_is_not_asked_again_after_a_resume(tmp_path: Path) -> None:
    """Halt a DP-SGD job after a round in which parties refused for their budget, resume
    it: the checkpointed strategy remembers them and never asks them again."""
    job = tmp_path / "job"
    manifest = _job(tmp_path, 'mode = "local"\nepsilon = 4.0\nrounds_per_party = 2', rounds=6)

    def halt_after_4(done: int, total: int, accuracy: float | None) -> None:
        if done == 4:
            assert halt_job(job) is RunState.RUNNING

    assert run_job(manifest, job, progress=halt_after_4).state is RunState.HALTED
    refused_before_halt = {
        int(party): row["round"]
        for row in _rounds(job)
        for party, why in row["failures"].items()
        if "BudgetExhaustedError" in why
    }
    assert refused_before_halt, [r["failures"] for r in _rounds(job)]
    resumed = resume_job(job)
    assert resumed.resumed_from == 4
    rows = _rounds(job)
    assert [r["round"] for r in rows][:5] == [1, 2, 3, 4, 5]
    for party, refused_in in refused_before_halt.items():
        asked_later = [
            r["round"] for r in rows if r["round"] > refused_in and party in r["selected"]
        ]
        assert asked_later == [], (party, refused_in, asked_later)
    assert any(r["round"] > 4 for r in rows)  # the resumed job did train on


def _rounds(job: Path) -> list[dict[str, Any]]:
    store = RunStore(job / RUNS_DB)
    try:
        (run,) = store.runs()
        return store.rounds(run["run_id"])
    finally:
        store.close()


@pytest.mark.slow
def test_a_tier_whose_parties_are_all_out_of_budget_is_never_drawn_again(
    tmp_path: Path,
) -> None:
    """TiFL re-forms its tiers from the parties still able to train: once a whole tier
    refused, later rounds draw only live tiers (never the dead one, never 'everyone')."""
    text = SCENARIO.replace("rounds = 5", "rounds = 8").replace(
        "rounds_per_party = 2", "rounds_per_party = 3"
    )
    (tmp_path / "scenario.toml").write_text(text)
    curve = runner.run_one(load_scenario(str(tmp_path / "scenario.toml")), "tiered-dp", seed=0)
    dead: set[int] = set()
    whole_tier_round = None
    for record in curve.rounds:
        assert set(dead).isdisjoint(record.selected), (record.server_round, dead)
        if dead:
            assert record.tier is not None, record
        refused = {n for n, why in record.failures.items() if "BudgetExhaustedError" in why}
        if refused and refused == set(record.selected) and whole_tier_round is None:
            whole_tier_round = record.server_round
        dead |= refused
    assert whole_tier_round is not None, [(r.tier, r.selected, r.failures) for r in curve.rounds]
    later = [r for r in curve.rounds if r.server_round > whole_tier_round]
    assert later and all(r.on_time for r in later[:1])  # the live tier trained after it


def test_central_dp_with_more_rounds_than_its_epsilon_allows_trains_nothing(
    tmp_path: Path,
) -> None:
    """sigma 1.0 for 5 rounds costs a station epsilon of 9.7 > 6: refused when the
    manifest loads, before a job directory or a round exists."""
    job = tmp_path / "job"
    manifest = _job(tmp_path, 'mode = "central"\nnoise_multiplier = 1.0\nepsilon = 6.0', rounds=5)
    refusal = r"at most 2 rounds, or raise privacy\.noise_multiplier"
    with pytest.raises(ManifestError, match=refusal):
        run_job(manifest, job)
    assert not (job / RUNS_DB).exists()


def test_a_central_dp_job_reports_its_station_epsilon(tmp_path: Path) -> None:
    job = tmp_path / "job"
    manifest = _job(
        tmp_path, 'mode = "central"\nnoise_multiplier = 1.0\nclipping_norm = 0.5', rounds=2
    )
    assert run_job(manifest, job).state is RunState.COMPLETED
    rows = _rounds(job)
    spent = [r["train_metrics"]["dp-epsilon-station"] for r in rows]
    spec = PrivacySpec(mode=PrivacyMode.CENTRAL, noise_multiplier=1.0, clipping_norm=0.5)
    assert spent == [station_epsilon(spec, 1), station_epsilon(spec, 2)]
    (status,) = job_status(job)
    assert status.privacy == [
        {
            "party": None,
            "name": "all stations (central DP)",
            "rounds": 2,
            "epsilon_job": spent[-1],
            "epsilon_total": spent[-1],
            "last_round": 2,
        }
    ]
    shown = CliRunner().invoke(app, ["aggregator", "status", "--dir", str(job)])
    assert shown.exit_code == 0, shown.output
    # The name may wrap in an 80-column table: its first words and the epsilon suffice.
    assert "all stations" in shown.output and f"{spent[-1]:.3f}" in shown.output

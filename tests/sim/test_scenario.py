"""Scenario manifests: the shipped files load, and every bad field is named in the error."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedge.errors import FedgeError
from fedge.sim.scenario import (
    FleetSpec,
    GroupSpec,
    ScenarioError,
    load_scenario,
    parse_scenario,
    scenario_path,
    shipped_scenarios,
)

VALID = """
name = "tiny"
description = "two groups"

[data]
alpha = 0.5

[fleet]
parties = 4
per_round = 2

[[fleet.groups]]
count = 2
cpus = 4.0
data_share = 0.4

[[fleet.groups]]
count = 2
cpus = 0.5
data_share = 0.6
bandwidth_mbps = 2.0

[device]
seconds_per_example = 0.01

[training]
rounds = 10
lr = 0.1
local_epochs = 1
batch_size = 10
target_accuracy = 0.9

[strategies.tiered]
tiers = 2
adaptive = true
"""


def edited(old: str, new: str) -> str:
    assert old in VALID, old
    return VALID.replace(old, new, 1)


def test_the_tifl_digits_scenario_matches_tifl_setup() -> None:
    scenario = load_scenario("tifl-digits")
    assert scenario.name == "tifl-digits"
    assert scenario.data.alpha == 0.5
    assert (scenario.fleet.parties, scenario.fleet.per_round) == (50, 5)
    assert [g.cpus for g in scenario.fleet.groups] == [4.0, 2.0, 1.0, 0.5, 0.1]
    assert [g.count for g in scenario.fleet.groups] == [10] * 5
    # Shares in group order: the fastest group holds the least data.
    assert [g.data_share for g in scenario.fleet.groups] == [0.10, 0.15, 0.20, 0.25, 0.30]
    assert scenario.training.rounds == 300
    assert scenario.training.target_accuracy == 0.94
    assert scenario.training.arch == "mlp"
    assert scenario.strategy("fedavg") == {}
    assert scenario.strategy("tiered") == {
        "tiers": 5,
        "profiling_rounds": 1,
        "adaptive": False,
        "static_probabilities": [0.3, 0.25, 0.2, 0.15, 0.1],
    }
    assert scenario.strategy("tiered-adaptive")["credits_per_tier"] == [300, 300, 300, 300, 10]
    assert scenario.strategy("tiered-deadline")["late_policy"] == "stale"
    assert Path(scenario.source) == scenario_path("tifl-digits")


def test_the_noniid_scenario_differs_only_in_skew() -> None:
    iid = load_scenario("tifl-digits")
    noniid = load_scenario("tifl-digits-noniid")
    assert noniid.data.alpha == 0.1
    assert noniid.fleet == iid.fleet
    assert noniid.device == iid.device
    assert noniid.training == iid.training
    assert noniid.strategies == iid.strategies
    assert {"tifl-digits", "tifl-digits-noniid"} <= set(shipped_scenarios())


def test_a_path_loads_as_well_as_a_name(tmp_path: Path) -> None:
    path = tmp_path / "tiny.toml"
    path.write_text(VALID)
    scenario = load_scenario(str(path))
    assert scenario.name == "tiny"
    assert scenario.device.bandwidth_mbps == 10.0  # default
    assert scenario.fleet.groups[1] == GroupSpec(2, 0.5, 0.6, 2.0)
    assert scenario.training.proximal_mu == 0.0
    assert hash(scenario) == hash(parse_scenario(VALID))  # usable as a cache key


def test_a_lognormal_fleet_needs_no_groups() -> None:
    start = VALID.index("[[fleet.groups]]")
    end = VALID.index("[device]")
    text = VALID[:start] + VALID[end:]
    text = text.replace("per_round = 2", 'per_round = 2\nspeed_distribution = "lognormal"')
    with pytest.raises(ScenarioError, match=r"missing field fleet\.lognormal_sigma"):
        parse_scenario(text)
    scenario = parse_scenario(text.replace("per_round = 2", "per_round = 2\nlognormal_sigma = 0.6"))
    assert scenario.fleet.speed_distribution == "lognormal"
    assert scenario.fleet.lognormal_sigma == 0.6
    assert scenario.fleet.groups == ()


@pytest.mark.parametrize(
    ("text", "message"),
    [
        (VALID.replace("[training]", "[trainig]"), r"unknown field 'trainig'"),
        (
            edited("lr = 0.1", "lr = 0.1\nlearning_rate = 1"),
            r"unknown field 'training\.learning_rate'",
        ),
        (edited("cpus = 4.0", "cpus = 4.0\ncpu = 1"), r"unknown field 'fleet\.groups\[0\]\.cpu'"),
        (edited("parties = 4", "parties = -3"), r"fleet\.parties must be >= 1, got -3"),
        (
            edited("data_share = 0.6", "data_share = 0.5"),
            r"fleet\.groups\[\*\]\.data_share must sum to 1, got 0\.9",
        ),
        (edited("alpha = 0.5\n", ""), r"missing field data\.alpha"),
        (edited('name = "tiny"\n', ""), r"missing field name"),
        (edited("cpus = 0.5", "cpus = 0"), r"fleet\.groups\[1\]\.cpus must be > 0, got 0"),
        (
            edited("count = 2\ncpus = 0.5", "count = 3\ncpus = 0.5"),
            r"fleet\.groups\[\*\]\.count must sum to fleet\.parties \(4\), got 5",
        ),
        (edited("per_round = 2", "per_round = 5"), r"fleet\.per_round must be <= fleet\.parties"),
        (edited("rounds = 10", "rounds = 10.5"), r"training\.rounds must be an integer"),
        (edited("lr = 0.1", 'lr = "fast"'), r"training\.lr must be a number"),
        (
            edited("seconds_per_example = 0.01", "seconds_per_example = 0.01\navailability = 0"),
            r"device\.availability must be in \(0, 1\], got 0",
        ),
        (
            edited("seconds_per_example = 0.01", "seconds_per_example = 0.01\ndropout = 1.0"),
            r"device\.dropout must be < 1",
        ),
        (edited("alpha = 0.5", 'alpha = 0.5\ndataset = "mnist"'), r"data\.dataset must be one of"),
        (
            edited("alpha = 0.5", "alpha = 0.5\ntest_fraction = 1.0"),
            r"data\.test_fraction must be in \(0, 1\)",
        ),
        (
            edited("[strategies.tiered]\n", "[strategies]\ntiered = 3\n"),
            r"strategies\.tiered must be a table",
        ),
        ("name = [", r"not valid TOML"),
    ],
)
def test_bad_manifests_name_the_field(text: str, message: str) -> None:
    with pytest.raises(ScenarioError, match=message):
        parse_scenario(text)


def test_errors_are_fedge_errors_and_unknown_names_list_the_shipped_ones() -> None:
    with pytest.raises(FedgeError, match=r"no scenario 'nope'.*tifl-digits"):
        load_scenario("nope")


def test_building_in_code_validates_too() -> None:
    with pytest.raises(ScenarioError, match=r"fleet\.parties must be >= 1, got 0"):
        FleetSpec(parties=0, per_round=1, groups=(GroupSpec(1, 1.0, 1.0),))
    fleet = FleetSpec(
        parties=3, per_round=1, groups=(GroupSpec(1, 1.0, 0.5), GroupSpec(2, 2.0, 0.5))
    )
    assert [fleet.group_of(pid) for pid in range(3)] == [0, 1, 1]


def test_a_strategy_may_run_its_own_number_of_rounds() -> None:
    scenario = parse_scenario(VALID + '\n[strategies.fedavg]\nkind = "fedavg"\nrounds = 25\n')
    assert scenario.rounds_for("fedavg") == 25
    assert scenario.rounds_for("tiered") == 10  # training.rounds
    assert "rounds" not in scenario.strategy("fedavg")  # not a strategy parameter
    assert scenario.strategy("fedavg") == {"kind": "fedavg"}
    # `fedge sim --rounds N` runs every strategy N rounds.
    everyone = scenario.with_rounds(3)
    assert (everyone.rounds_for("fedavg"), everyone.rounds_for("tiered")) == (3, 3)
    for bad in ("0", "2.5", '"25"', "true"):
        with pytest.raises(ScenarioError, match=r"strategies\.fedavg\.rounds"):
            parse_scenario(VALID + f"\n[strategies.fedavg]\nrounds = {bad}\n")

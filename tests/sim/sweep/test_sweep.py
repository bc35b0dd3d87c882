"""``fedge sim --sweep``: a spec is checked before anything is queued; a tiny sweep runs
its trials as BE jobs on the scheduler's queue, ranks them and writes the best as a fleet
job manifest that ``fedge jobs submit --manifest`` accepts."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.aggregator.fleet.manifest import load_fleet_manifest
from fedge.cli.main import app
from fedge.edge_manager.scheduler import store as queue_store
from fedge.edge_manager.store import Store
from fedge.sim.sweep.spec import Choices, Range, SweepError, parse_sweep

EXAMPLES = Path(__file__).resolve().parents[3] / "examples"
SPEC = f"""
[sweep]
name = "tiny"
trials = 3
team = "sweeps"

[base]
manifest = "{EXAMPLES / "jobs" / "tiered-digits.toml"}"
rounds = 2

[space]
lr = {{ low = 0.05, high = 0.4, log = true }}
tiers = [2, 3]
deadline_factor = [1.5, 4.0]
local_epochs = {{ choices = [1] }}

[fleet_job]
name = "retrain"
model = "inspect:1"
fleet = "plant-a"
rounds = 3
"""


def test_a_spec_parses_into_ranges_and_choices(tmp_path: Path) -> None:
    spec = parse_sweep(SPEC, base_dir=tmp_path)
    assert spec.space == {
        "lr": Range(0.05, 0.4, integer=False, log=True),
        "tiers": Range(2, 3, integer=True),
        "deadline_factor": Range(1.5, 4.0, integer=False),
        "local_epochs": Choices((1,)),
    }
    assert (spec.trials, spec.parallel, spec.team, spec.base_rounds) == (3, 1, "sweeps", 2)
    assert spec.fleet.model == "inspect:1" and spec.fleet.edges == "all"


@pytest.mark.parametrize(
    ("old", "new", "message"),
    [
        ("tiers = [2, 3]", "tiers = [3, 3]", "space.tiers: the range [3, 3] is empty"),
        ("tiers = [2, 3]", "tiers = [4, 2]", "space.tiers: the range [4, 2] is empty"),
        ("choices = [1]", "choices = []", "space.local_epochs.choices is empty"),
        ("tiers = [2, 3]", "momentum = [0.1, 0.9]", "space.momentum: not a searchable"),
        ("tiers = [2, 3]", "tiers = [2.5, 3]", "takes whole numbers"),
        ("low = 0.05", "low = 0.0", "log range needs low > 0"),
        ("trials = 3", "trials = 0", "sweep.trials: expected a whole number >= 1"),
        ('model = "inspect:1"\n', "", "fleet_job: give model"),
    ],
)
def test_a_bad_spec_is_one_clear_error(tmp_path: Path, old: str, new: str, message: str) -> None:
    with pytest.raises(SweepError, match=message.replace("[", r"\[").replace("]", r"\]")):
        parse_sweep(SPEC.replace(old, new), base_dir=tmp_path)


def _sweep(tmp_path: Path, spec: str, out: Path) -> tuple[int, str]:
    path = tmp_path / "sweep.toml"
    path.write_text(spec)
    result = CliRunner().invoke(
        app, ["sim", "--sweep", str(path), "--out", str(out), "--json", str(tmp_path / "s.json")]
    )
    return result.exit_code, " ".join(result.output.split())


def test_an_empty_range_queues_nothing(tmp_path: Path) -> None:
    out = tmp_path / "out"
    code, output = _sweep(tmp_path, SPEC.replace("tiers = [2, 3]", "tiers = [3, 3]"), out)
    assert code == 1 and output.startswith("error: space.tiers: the range [3, 3] is empty"), output
    assert not out.exists()
    code, output = _sweep(
        tmp_path, SPEC.replace("[space]", "[space]\nnoise_multiplier = [0.5, 1.5]"), out
    )
    assert code == 1 and "the base manifest has no [privacy]" in output, output
    assert not out.exists()


@pytest.mark.integration  # trains three small federated jobs (a few seconds each)
def test_a_tiny_sweep_ranks_its_trials_and_writes_the_best_as_a_fleet_job(
    tmp_path: Path,
) -> None:
    out = tmp_path / "out"
    code, output = _sweep(tmp_path, SPEC, out)
    assert code == 0, output
    report = json.loads((out / "sweep.json").read_text())
    assert json.loads((tmp_path / "s.json").read_text()) == report
    trials = report["trials"]
    assert [t["rank"] for t in trials] == [1, 2, 3]
    assert {t["job_id"] for t in trials} == {"tiny-t000", "tiny-t001", "tiny-t002"}
    assert all(t["state"] == "completed" for t in trials)
    accuracies = [t["accuracy"] for t in trials]
    assert accuracies == sorted(accuracies, reverse=True) and 0.0 < accuracies[0] <= 1.0
    for t in trials:
        assert 0.05 <= t["params"]["lr"] <= 0.4 and t["params"]["tiers"] in (2, 3)
        assert t["params"]["local_epochs"] == 1
    best = report["best"]
    assert best == {k: v for k, v in trials[0].items() if k != "rank"}

    # Each trial was a BE job on the scheduler's queue: queued, placed, completed.
    store = Store(out / "queue.db")
    try:
        for t in trials:
            record = queue_store.job(store, t["job_id"])
            assert (record.job.kind.value, record.job.team, record.state.value) == (
                "be", "sweeps", "completed",
            )  # fmt: skip
            states = [e.state for e in queue_store.events(store, t["job_id"])]
            assert states == ["queued", "running", "completed"]
    finally:
        store.close()

    fleet = load_fleet_manifest(out / "best-fleet-job.toml")
    assert (fleet.name, fleet.job.rounds, fleet.task.model) == ("retrain", 3, "inspect:1")
    assert fleet.task.lr == pytest.approx(best["params"]["lr"])
    assert fleet.kind == "tiered"
    assert fleet.params["tiers"] == best["params"]["tiers"]
    assert fleet.params["deadline_factor"] == pytest.approx(best["params"]["deadline_factor"])
    assert "tiny-t000: completed, accuracy" in output
    assert "queue it: fedge jobs submit --manifest" in output

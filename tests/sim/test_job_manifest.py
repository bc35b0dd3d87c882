"""Job manifests: a good one parses, every bad one names its field and creates nothing."""

from __future__ import annotations

from pathlib import Path

import pytest

from fedge.aggregator.fleet.manifest import is_fleet_manifest, load_fleet_manifest
from fedge.aggregator.jobs.spec import CheckpointSpec, ManifestError
from fedge.errors import FedgeError
from fedge.sim.job_manifest import FederationSpec, load_manifest, parse_manifest
from fedge.sim.jobs import run_job
from fedge.sim.scenario import SCENARIO_DIR

REPO = Path(__file__).resolve().parents[2]

SCENARIO = """
name = "tiny"
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
[device]
seconds_per_example = 0.01
[training]
rounds = 10
lr = 0.1
local_epochs = 1
batch_size = 10
target_accuracy = 0.9
"""

GOOD = """
[job]
name = "tiny-job"
rounds = 5
seed = 7

[task]
scenario = "scenario.toml"
arch = "mlp-small"

[strategy]
kind = "tiered"

[strategy.params]
tiers = 2
late_policy = "stale"
over_selection = 0.5

[federation]
backend = "inprocess"
workers = 3

[checkpoint]
every = 2
keep = 4
"""


def edited(old: str, new: str) -> str:
    assert old in GOOD, old
    return GOOD.replace(old, new, 1)


@pytest.fixture
def folder(tmp_path: Path) -> Path:
    (tmp_path / "scenario.toml").write_text(SCENARIO)
    return tmp_path


def write(folder: Path, text: str) -> Path:
    path = folder / "job.toml"
    path.write_text(text)
    return path


def listing(root: Path) -> set[Path]:
    return set(root.rglob("*"))


def test_good_manifest(folder: Path) -> None:
    manifest = load_manifest(write(folder, GOOD))
    assert (manifest.name, manifest.rounds, manifest.seed) == ("tiny-job", 5, 7)
    assert manifest.task.scenario == "scenario.toml"
    assert manifest.task.scenario_file == (folder / "scenario.toml").resolve()
    assert manifest.task.arch == "mlp-small"
    assert manifest.strategy.kind == "tiered"
    assert dict(manifest.strategy.params) == {
        "tiers": 2,
        "late_policy": "stale",
        "over_selection": 0.5,
    }
    assert manifest.strategy_params()["kind"] == "tiered"
    assert manifest.federation == FederationSpec("inprocess", 3)
    assert manifest.checkpoint == CheckpointSpec(every=2, keep=4)
    # The job's rounds and arch apply to the scenario it trains.
    assert manifest.scenario.training.rounds == 5
    assert manifest.scenario.training.arch == "mlp-small"
    assert manifest.scenario.fleet.parties == 4
    assert manifest.text == GOOD


def test_defaults_and_shipped_scenario(tmp_path: Path) -> None:
    text = """
[job]
name = "j"
rounds = 1
seed = 0
[task]
scenario = "tifl-digits"
[strategy]
kind = "fedavg"
"""
    manifest = parse_manifest(text, base_dir=tmp_path)
    assert manifest.task.scenario_file == SCENARIO_DIR / "tifl-digits.toml"
    assert manifest.task.arch == "mlp"  # the scenario's
    assert manifest.federation == FederationSpec("inprocess", 2)
    assert manifest.checkpoint == CheckpointSpec(every=1, keep=3)
    assert dict(manifest.strategy.params) == {}


@pytest.mark.parametrize("backend", ["flower", "deployment"])
def test_other_backends_are_valid_manifests(folder: Path, backend: str) -> None:
    manifest = parse_manifest(
        edited('backend = "inprocess"', f'backend = "{backend}"'), base_dir=folder
    )
    assert manifest.federation.backend == backend


def test_shipped_example_manifest() -> None:
    manifest = load_manifest(REPO / "examples" / "jobs" / "tiered-digits.toml")
    assert manifest.name == "tiered-digits"
    assert manifest.strategy.kind == "tiered"
    assert manifest.task.scenario_file == SCENARIO_DIR / "tifl-digits.toml"
    assert manifest.federation.backend == "inprocess"


BAD = [
    pytest.param(
        edited('kind = "tiered"', 'kind = "fedsgd"'),
        "strategy.kind: unknown strategy 'fedsgd' "
        "(known: fedavg, fedprox, tiered, distill, nested)",
        id="unknown-strategy",
    ),
    pytest.param(
        edited('kind = "tiered"', 'kind = "distill"'),
        "task.arch: distill trains one architecture per tier",
        id="distill-with-task-arch",
    ),
    pytest.param(
        edited("rounds = 5", "rounds = -3"), "job.rounds must be >= 1, got -3", id="negative-rounds"
    ),
    pytest.param(edited("seed = 7\n", ""), "missing field job.seed", id="missing-seed"),
    pytest.param(
        edited("seed = 7\n", "seed = 7\ncolour = 'blue'\n"),
        "unknown field 'job.colour'",
        id="unknown-field",
    ),
    pytest.param(
        edited("tiers = 2", "tiers = 2\nwarp = 9"),
        "strategy.params.warp: not a parameter of tiered",
        id="unknown-strategy-param",
    ),
    pytest.param(
        edited("tiers = 2", 'tiers = "two"'),
        "strategy.params.tiers: expected int, got str",
        id="mistyped-strategy-param",
    ),
    pytest.param(
        edited('late_policy = "stale"', 'late_policy = "later"'),
        "strategy.params: late_policy must be 'drop' or 'stale'",
        id="bad-strategy-value",
    ),
    pytest.param(
        edited("tiers = 2", 'tiers = 2\nserver_opt = "fedadam"\nserver_lr = 0.0'),
        "strategy.params: server_lr must be a number > 0, got 0.0",
        id="server-lr-zero",
    ),
    pytest.param(
        edited("tiers = 2", 'tiers = 2\nserver_opt = "fedyogi"\nbeta2 = 1.0'),
        "strategy.params: beta2 must be in [0, 1), got 1.0",
        id="beta2-one",
    ),
    pytest.param(
        edited("tiers = 2", 'tiers = 2\nserver_opt = "fedadagrad"\ntau = -0.001'),
        "strategy.params: tau must be a number > 0",
        id="tau-negative",
    ),
    pytest.param(
        edited('kind = "tiered"', 'kind = "fedadam"'),
        "strategy.kind: 'fedadam' is a server optimizer, not a strategy",
        id="optimizer-as-kind",
    ),
    pytest.param(
        edited('scenario = "scenario.toml"', 'scenario = "nowhere.toml"'),
        "task.scenario: no scenario",
        id="missing-scenario",
    ),
    pytest.param(
        edited('arch = "mlp-small"', 'arch = "resnet"'),
        "task.arch: unknown architecture 'resnet'",
        id="unknown-arch",
    ),
    pytest.param(
        edited("seed = 7", 'seed = "seven"'), "job.seed must be an integer", id="mistyped-seed"
    ),
    pytest.param(
        edited('name = "tiny-job"', 'name = "tiny job!"'), "job.name must be", id="bad-name"
    ),
    pytest.param(
        edited('backend = "inprocess"', 'backend = "ray"'),
        "federation.backend must be one of inprocess, flower, deployment, got 'ray'",
        id="unknown-backend",
    ),
    pytest.param(edited("workers = 3", "workers = 0"), "federation.workers must be >= 1", id="w0"),
    pytest.param(edited("every = 2", "every = 0"), "checkpoint.every must be >= 1", id="every0"),
    pytest.param(GOOD.replace("[task]", "[tasks]"), "unknown field 'tasks'", id="unknown-section"),
    pytest.param(GOOD + "\n[job\n", "is not valid TOML", id="bad-toml"),
]


@pytest.mark.parametrize(("text", "message"), BAD)
def test_bad_manifest_names_the_field_and_creates_nothing(
    folder: Path, text: str, message: str
) -> None:
    path = write(folder, text)
    before = listing(folder)
    with pytest.raises(ManifestError) as caught:
        load_manifest(path)
    assert message in str(caught.value)
    assert isinstance(caught.value, FedgeError)
    # The job runner validates first: a bad manifest leaves no job directory behind.
    job_dir = folder / "jobs" / "tiny"
    with pytest.raises(ManifestError) as again:
        run_job(path, job_dir)
    assert message in str(again.value)
    assert listing(folder) == before
    assert not job_dir.exists()


def test_missing_manifest_file(tmp_path: Path) -> None:
    with pytest.raises(ManifestError, match="no job manifest at"):
        load_manifest(tmp_path / "absent.toml")


@pytest.mark.parametrize("backend", ["flower", "deployment"])
def test_run_job_refuses_other_backends_before_creating_anything(
    folder: Path, backend: str
) -> None:
    path = write(folder, edited('backend = "inprocess"', f'backend = "{backend}"'))
    before = listing(folder)
    with pytest.raises(ManifestError, match=f"federation.backend: '{backend}'"):
        run_job(path, folder / "job")
    assert listing(folder) == before


def test_every_example_job_validates() -> None:
    examples = sorted((Path(__file__).parents[2] / "examples" / "jobs").glob("*.toml"))
    assert {p.stem for p in examples} >= {"tiered-digits", "distill-digits", "fleet-inspect"}
    for path in examples:
        if is_fleet_manifest(path.read_text(encoding="utf-8")):
            assert load_fleet_manifest(path).job.rounds >= 1, path
            continue
        manifest = load_manifest(path)
        assert manifest.rounds >= 1, path

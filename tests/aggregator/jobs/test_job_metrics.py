"""A job's Prometheus metrics, read from its run store (issue 27, item 1): the pure
histogram, and a real small job (tiered, central DP) scraped over HTTP afterwards."""

import urllib.request
from pathlib import Path

import pytest
from prometheus_client.parser import text_string_to_metric_families

from fedge.aggregator.jobs.directory import RUNS_DB
from fedge.aggregator.jobs.metrics import round_histogram, serve_job_metrics
from fedge.aggregator.jobs.run_store import CENTRAL_DP_ROW, RunState, RunStore
from fedge.sim.jobs import run_job

ROUNDS = 3
SCENARIO = """
name = "tiny-metrics"
[data]
alpha = 0.5
[fleet]
parties = 6
per_round = 3
[[fleet.groups]]
count = 3
cpus = 4.0
data_share = 0.5
[[fleet.groups]]
count = 3
cpus = 0.5
data_share = 0.5
[device]
seconds_per_example = 0.05
jitter_sigma = 0.1
[training]
rounds = 3
lr = 0.2
local_epochs = 1
batch_size = 5
target_accuracy = 0.9
"""
JOB = f"""
[job]
name = "tiny-metrics"
rounds = {ROUNDS}
seed = 3

[task]
scenario = "scenario.toml"

[strategy]
kind = "tiered"

[strategy.params]
tiers = 2
profiling_rounds = 1

[privacy]
mode = "central"
noise_multiplier = 1.0
clipping_norm = 0.5

[federation]
workers = 2
"""


def test_the_histogram_is_cumulative_and_ends_at_inf() -> None:
    buckets, total = round_histogram([0.5, 3.0, 45.0])
    assert dict(buckets)["1.0"] == 1.0
    assert dict(buckets)["5.0"] == 2.0
    assert dict(buckets)["60.0"] == 3.0
    assert buckets[-1] == ("+Inf", 3.0)
    assert total == 48.5


def test_a_store_not_there_yet_gives_no_job_series(tmp_path: Path) -> None:
    from fedge.aggregator.jobs.metrics import JobCollector

    families = list(JobCollector(tmp_path / "none.db").collect())
    assert families and all(family.samples == [] for family in families)
    assert not (tmp_path / "none.db").exists()  # a scrape creates no store


@pytest.mark.integration
def test_a_small_jobs_rounds_parties_and_epsilon_are_scraped(tmp_path: Path) -> None:
    (tmp_path / "scenario.toml").write_text(SCENARIO)
    (tmp_path / "job.toml").write_text(JOB)
    job_dir = tmp_path / "job"
    assert run_job(tmp_path / "job.toml", job_dir).state is RunState.COMPLETED
    store = RunStore(job_dir / RUNS_DB)
    (run,) = store.runs()
    rounds = store.rounds(str(run["run_id"]))
    store.close()
    server = serve_job_metrics(job_dir / RUNS_DB, "127.0.0.1", 0)
    server.start()
    try:
        with urllib.request.urlopen(f"{server.url}/metrics", timeout=10) as response:
            text = response.read().decode()
    finally:
        server.stop()
    samples = {
        (s.name, tuple(sorted(s.labels.items()))): s.value
        for family in text_string_to_metric_families(text)
        for s in family.samples
    }
    run_id = str(run["run_id"])

    def value(name: str, **labels: str) -> float:
        return samples[(name, tuple(sorted({"run": run_id, **labels}.items())))]

    assert value("fedge_job_rounds_completed_total") == ROUNDS == len(rounds)
    assert value("fedge_job_round_duration_seconds_count") == ROUNDS
    assert value("fedge_job_round_duration_seconds_sum") == pytest.approx(
        sum(r["round_time_s"] for r in rounds)
    )
    assert value("fedge_job_last_round_duration_seconds") == rounds[-1]["round_time_s"]
    newest = rounds[-1]
    for outcome in ("selected", "on_time", "late", "failed"):
        assert value("fedge_job_round_parties", outcome=outcome) == len(newest[outcome])
        total = sum(len(r[outcome]) for r in rounds)
        assert value("fedge_job_parties_total", outcome=outcome) == total
    assert value("fedge_job_round_parties", outcome="selected") > 0
    epsilon = value("fedge_job_epsilon_spent", station=CENTRAL_DP_ROW)
    assert 0 < epsilon < float("inf")
    assert value("fedge_job_state", state="completed") == 1.0
    assert value("fedge_job_state", state="running") == 0.0

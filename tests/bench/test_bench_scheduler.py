"""The scheduler benchmark's replay on a small trace: every job runs to completion once,
the policies keep their promises, and the report carries the figures it claims."""

from dataclasses import replace

import pytest

from fedge.bench.scheduler import POLICIES, replay, run_scheduler_bench
from fedge.bench.scheduler_trace import TRACE, make_trace
from fedge.edge_manager.scheduler.policy import PolicyName
from fedge.edge_manager.scheduler.queue import JobKind

SMALL = replace(TRACE, stations=16)


def test_every_job_completes_once_under_every_policy() -> None:
    trace = make_trace(400, 0.3, 2.0, seed=1, shape=SMALL)
    te = sum(1 for t in trace if t.job.kind is JobKind.TE)
    for policy in POLICIES:
        result = replay(trace, policy, SMALL.stations)
        assert len(result.te_slowdowns) == te, policy.name
        assert len(result.be_slowdowns) == len(trace) - te, policy.name
        assert min(result.te_slowdowns + result.be_slowdowns) >= 1.0 - 1e-9, policy.name
        if not policy.preempts:
            assert result.suspensions == 0, policy.name


def test_fitgpp_preempts_each_job_at_most_its_cap() -> None:
    trace = make_trace(400, 0.3, 2.0, seed=2, shape=SMALL)
    fitgpp = next(p for p in POLICIES if p.name is PolicyName.FITGPP)
    result = replay(trace, fitgpp, SMALL.stations)
    assert result.suspensions > 0
    assert result.preempted_jobs == result.suspensions  # P = 1: nobody twice


def test_the_trace_has_the_asked_share_and_load() -> None:
    trace = make_trace(4000, 0.3, 2.0, seed=3, shape=SMALL)
    share = sum(t.job.kind is JobKind.TE for t in trace) / len(trace)
    assert abs(share - 0.3) < 0.03
    work = sum(t.job.demand * t.run_s for t in trace)
    span = trace[-1].job.submitted_at - trace[0].job.submitted_at
    assert abs(work / (span * SMALL.stations) - 2.0) < 0.2
    assert all(10.0 <= t.job.grace_s <= 1200.0 for t in trace)


@pytest.mark.integration  # machine_info() runs `mosquitto -h` and `uname`
def test_the_report_names_the_machine_and_the_baselines() -> None:
    result = run_scheduler_bench(jobs=200, seeds=1, shape=SMALL)
    assert result["machine"]["cpu_count"] >= 1
    assert set(result["policies"]) == {"fifo", "priority", "fitgpp", "lrtp", "rand"}
    assert result["policies"]["fifo"]["preemptions"] == [0]
    assert isinstance(result["met_target"], bool)
    assert result["te_p95_slowdown_reduction_vs_fifo"] == round(
        result["policies"]["fitgpp"]["te_p95_slowdown_reduction_vs_fifo"][0], 4
    )

"""A short seeded chaos run (issue 9): real broker, manager and agents under faults.

One minute of load on three agents while the schedule kills and restarts the broker,
the manager and agents, cuts, stalls and truncates agents' connections, fills a
station's disk, damages a served model and steps an agent's wall clock; then every
invariant must hold. The long
runs (``fedge bench chaos --agents 8 --minutes 5``) are benchmarks (BENCHMARKS.md).
"""

from pathlib import Path

import pytest

from fedge.bench.chaos import run_chaos

pytestmark = pytest.mark.integration


# A minute of load, then healing (up to 120 s) and stopping real processes: the test's own
# waits should decide that it hung, not pytest's 300 s default.
@pytest.mark.timeout(900)
def test_a_minute_of_chaos_loses_duplicates_and_hangs_nothing(tmp_path: Path) -> None:
    # Seed 2 at 12 faults a minute schedules every kind on three agents (one on a tmpfs).
    result = run_chaos(
        agents=3,
        minutes=1.0,
        seed=2,
        faults_per_minute=12.0,
        heal_timeout_s=120.0,
        workdir=tmp_path,
    )
    summary = {
        key: result[key]
        for key in (
            "lost",
            "duplicated",
            "hung_processes",
            "unconverged_edges",
            "open_gaps",
            "counter_issues",
            "unexpected_exits",
            "stop_timeouts",
            "heal_pending",
        )
    }
    assert summary == {
        "lost": 0,
        "duplicated": 0,
        "hung_processes": 0,
        "unconverged_edges": 0,
        "open_gaps": 0,
        "counter_issues": [],
        "unexpected_exits": [],
        "stop_timeouts": [],
        "heal_pending": [],
    }, result["details"]
    assert result["faults_injected"] >= 8, result["faults"]
    assert result["fault_kinds"] >= 6, result["faults_by_kind"]
    assert result["records_produced"] > 300
    assert result["records_stored"] == result["records_produced"]
    assert result["operator"]["threshold_pushes"] + result["operator"]["deployments"] >= 4

"""``fedge aggregator run`` with stdout not a terminal prints one line per round as the
round ends (issue 27: redirected, the progress bar printed nothing until the job ended).

A real ``fedge`` process on a pipe, running a short simulated job.
"""

import re
import subprocess
import urllib.request
from pathlib import Path

import pytest
from conftest import FEDGE, free_port

ROOT = Path(__file__).resolve().parents[2]

pytestmark = pytest.mark.integration


def test_each_round_is_a_line_read_while_the_job_still_runs(tmp_path: Path) -> None:
    manifest = (ROOT / "examples" / "jobs" / "tiered-digits.toml").read_text()
    short = tmp_path / "short.toml"
    short.write_text(re.sub(r"(?m)^rounds = \d+", "rounds = 3", manifest, count=1))
    process = subprocess.Popen(
        [str(FEDGE), "aggregator", "run", str(short), "--dir", str(tmp_path / "job")],
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        first = process.stdout.readline()
        # Flushed as round 1 ended: the job is still running rounds 2 and 3.
        running_at_first_line = process.poll() is None
        rest, errors = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, errors
    assert re.fullmatch(r"training: round 1/3 done, accuracy \d\.\d{4}, \d+\.\d s\n", first)
    assert running_at_first_line
    lines = rest.splitlines()
    assert [line.split(",")[0] for line in lines[:2]] == [
        "training: round 2/3 done",
        "training: round 3/3 done",
    ]
    assert lines[2].startswith("job ") and "completed after round 3/3" in lines[2]
    assert "\x1b[" not in first + rest  # no terminal control codes in a log


def test_a_running_job_serves_its_metrics(tmp_path: Path) -> None:
    """``--metrics-port``: Prometheus text from the job's run store while it runs."""
    manifest = (ROOT / "examples" / "jobs" / "tiered-digits.toml").read_text()
    short = tmp_path / "short.toml"
    short.write_text(re.sub(r"(?m)^rounds = \d+", "rounds = 4", manifest, count=1))
    port = free_port()
    command = [
        str(FEDGE), "aggregator", "run", str(short), "--dir", str(tmp_path / "job"),
        "--metrics-port", str(port),
    ]  # fmt: skip
    process = subprocess.Popen(
        command,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        text=True,
    )
    try:
        assert process.stdout is not None
        assert process.stdout.readline().strip() == f"job metrics: http://127.0.0.1:{port}/metrics"
        assert process.stdout.readline().startswith("training: round 1/4 done")
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        _, errors = process.communicate(timeout=300)
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
    assert process.returncode == 0, errors
    completed = re.search(r"(?m)^fedge_job_rounds_completed_total\{[^}]*\} (\S+)$", text)
    assert completed is not None and float(completed.group(1)) >= 1.0, text[:2000]
    # Scraped while the job ran: its state then was "running".
    assert re.search(r'(?m)^fedge_job_state\{[^}]*state="running"\} 1\.0$', text), text[-2000:]
    assert "fedge_job_round_duration_seconds_bucket" in text

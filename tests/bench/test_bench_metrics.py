"""``fedge bench metrics`` at a small size, through the CLI, with real components (issue 27):
the JSON contract, both sides stored every record once, and the scrapes really happened."""

import json
from pathlib import Path

import pytest
from typer.testing import CliRunner

from fedge.cli.main import app

pytestmark = pytest.mark.integration


def test_metrics_bench_scrapes_at_scale_and_compares_ingest(tmp_path: Path) -> None:
    out = tmp_path / "out.json"
    args = ["bench", "metrics", "--edges", "60", "--records", "8000", "--repeats", "1"]
    result = CliRunner().invoke(app, [*args, "--json", str(out)])
    assert result.exit_code == 0, result.output
    data = json.loads(out.read_text())
    assert {"edges", "scrape_p95_ms", "ingest_ratio", "met_target", "machine"} <= set(data)
    assert data["edges"] == 60
    assert data["scrapes"] >= 100  # the idle scrapes at least
    assert 0 < data["scrape_median_ms"] <= data["scrape_p95_ms"]
    assert data["ingest_ratio"] > 0
    runs = data["runs"]
    assert [r["metrics"] for r in runs["without_metrics"]] == [False]
    assert [r["metrics"] for r in runs["with_metrics"]] == [True]
    for run in (*runs["without_metrics"], *runs["with_metrics"]):
        assert (run["lost"], run["duplicated"]) == (0, 0)
    # The scrape named every station (one last-seen series each).
    assert data["metrics_bytes"] > 60 * len(
        'fedge_edge_last_seen_timestamp_seconds{edge="st-0000"}'
    )

"""The edge page's defect-score histograms (per model version, with the threshold that
decided) and its deployment history."""

import json
import re
import time
from collections.abc import Iterator

import pytest
from conftest import FleetHome, console_login, make_fleet_home, publish_model

from fedge.console.histograms import BINS, score_histograms


@pytest.fixture
def fh(tmp_path_factory: pytest.TempPathFactory) -> Iterator[FleetHome]:
    fh = make_fleet_home(tmp_path_factory.mktemp("hist"))
    publish_model(fh, 1)
    publish_model(fh, 2, seed=1)
    now = time.time()
    rows = []
    # inspect:1 (older): scratch scores 0.12 (x3, accepted) and 0.81 (x2, rejected) at 0.5
    for index, (score, decision) in enumerate([(0.12, "accept")] * 3 + [(0.81, "reject")] * 2):
        rows.append((f"a-{index}", "inspect:1", score, decision, 0.5, now - 100 + index))
    # inspect:2 (newer): at threshold 0.7; a foreign model's prediction is left out
    rows.append(("b-0", "inspect:2", 0.65, "accept", 0.7, now))
    rows.append(("c-0", "other:9", 0.9, "reject", 0.5, now))
    with fh.fleet() as fleet, fleet.store.transaction() as conn:
        for pid, model, score, decision, threshold, at in rows:
            conn.execute(
                "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
                "threshold, config_version, latency_ms, source) "
                "VALUES (?, 'st-01', 0, ?, ?, ?, ?, ?, 1, 1.0, '')",
                (
                    pid,
                    at,
                    model,
                    json.dumps({"clean": 1 - score, "scratch": score}),
                    decision,
                    threshold,
                ),
            )
        conn.execute(
            "INSERT INTO deploy_events (edge, deployment_id, stage, reason, serving, at) "
            "VALUES ('st-01', 'd-1', 'active', '', 'inspect:1', ?)",
            (now,),
        )
    yield fh
    fh.close()


def test_one_histogram_per_model_version_with_its_threshold(fh: FleetHome) -> None:
    with fh.fleet() as fleet:
        found = score_histograms(fleet, "st-01")
    assert [h.model for h in found] == ["inspect:2", "inspect:1"]
    newer, older = found
    assert (newer.n, newer.threshold, newer.counts[int(0.65 * BINS)]) == (1, 0.7, 1)
    assert older.n == 5 and older.threshold == 0.5
    assert older.counts[int(0.12 * BINS)] == 3 and older.rejects[int(0.12 * BINS)] == 0
    assert older.counts[int(0.81 * BINS)] == 2 and older.rejects[int(0.81 * BINS)] == 2
    svg = older.svg()
    assert svg.startswith("<svg") and "threshold 0.5" in svg and "<script" not in svg


def test_the_edge_page_shows_them_and_the_deployment_history(fh: FleetHome) -> None:
    client, _ = console_login(fh, "viewer")
    edge = client.get("/edges/st-01").text
    assert re.findall(r'<figure class="histogram" data-model="([^"]+)"', edge) == [
        "inspect:2",
        "inspect:1",
    ]
    deploys = edge.split('id="deploys"', 1)[1].split("</table>", 1)[0]
    assert "d-1" in deploys and "active" in deploys
    empty = client.get("/edges/st-02").text
    assert "No scored predictions" in empty and "No deployment reached this edge" in empty

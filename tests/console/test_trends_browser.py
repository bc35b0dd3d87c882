"""An edge's trends drawn by uPlot in a real Chromium (issue 27, item 8).

A manager store holds eight monitor windows of st-01, made by the real monitor
(``Monitor.tick``) over predictions written as ingest writes them, with labels given
through the library: the first four in distribution, the last four under a brighter lamp
with more rejects. A ``fedge console`` process serves the edge page; in Chromium the
page's two uPlot charts hold the series (four and four, eight points each), their
canvases are drawn (pixels other than the background) and the vendored uPlot is the one
served (never a CDN). Screenshot at 1600x1000 in the test's tmp dir (``screenshots/``).
"""

import base64
import io
import json
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
from conftest import (
    FleetHome,
    Processes,
    free_port,
    make_fleet_home,
    port_open,
    publish_model,
    wait_until,
)
from PIL import Image
from selenium.webdriver.common.by import By
from selenium.webdriver.remote.webdriver import WebDriver

from fedge.console import accounts
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.monitor.tick import Monitor, policy_from

from .chromium import Shots, log_in, open_chromium, wait_for

pytestmark = pytest.mark.integration

EDGE = "st-01"
MODEL = "inspect:1"
WINDOW = 50
WINDOWS = 8
HOUR = 3600.0
START = 1_700_000_000.0


@pytest.fixture
def browser(tmp_path: Path) -> Iterator[WebDriver]:
    driver = open_chromium(tmp_path, (1600, 1000))
    try:
        yield driver
    finally:
        driver.quit()


def _stats(rng: np.random.Generator, brightness: float) -> str:
    mean, std = float(rng.normal(brightness, 0.03)), float(rng.normal(0.2, 0.02))
    return json.dumps(
        {"mean": mean, "std": std, "p05": mean - 1.6 * std, "p95": mean + 1.6 * std,
         "edges": float(rng.normal(0.1, 0.01))}
    )  # fmt: skip


def _scores(rng: np.random.Generator, defect: bool) -> str:
    top = float(rng.uniform(0.8, 0.99))
    return json.dumps(
        {"clean": 1 - top, "scratch": top} if defect else {"clean": top, "scratch": 1 - top}
    )


def _gate_evaluations(fh: FleetHome, rng: np.random.Generator) -> None:
    """Held-out images the gate evaluated inspect:1 on (labelled; right 9 times in 10):
    the drift reference and the MPP fit, as edge_manager/gate stores them."""
    rows, labels = [], []
    for i in range(WINDOW * 2):
        image = f"h-{i}"
        label = "scratch" if i % 3 == 0 else "clean"
        predicted = label if i % 10 else ("clean" if label == "scratch" else "scratch")
        rows.append(("e-1", EDGE, image, MODEL, label, _scores(rng, predicted == "scratch"),
                     _stats(rng, 0.45), START - HOUR, 0))  # fmt: skip
        labels.append((f"l-{image}", image, EDGE, label, "op", START - HOUR, "operator"))
    fh.db.conn.executemany(
        "INSERT INTO evaluations (eval_id, edge, prediction_id, model, label, scores, stats, "
        "at, augmented) VALUES (?,?,?,?,?,?,?,?,?)",
        rows,
    )
    fh.db.conn.executemany(
        "INSERT INTO labels (label_id, prediction_id, edge, label, who, at, origin) "
        "VALUES (?,?,?,?,?,?,?)",
        labels,
    )


def _window(fh: FleetHome, rng: np.random.Generator, k: int) -> None:
    """Window ``k``: WINDOW predictions an hour apart from the last; from window 4 on,
    under a brighter lamp and rejecting more."""
    shifted = k >= WINDOWS // 2
    reject_every = 3 if shifted else 8
    rows = []
    for i in range(WINDOW):
        n = k * WINDOW + i
        reject = i % reject_every == 0
        at = START + k * HOUR + i * (HOUR / WINDOW)
        rows.append((f"p-{n}", EDGE, n + 1, at, MODEL, _scores(rng, reject),
                     "reject" if reject else "accept", 0.5, 1, 1.0, "",
                     _stats(rng, 0.75 if shifted else 0.45)))  # fmt: skip
    fh.db.conn.executemany(
        "INSERT INTO predictions (prediction_id, edge, seq, at, model, scores, decision, "
        "threshold, config_version, latency_ms, source, stats) VALUES (?,?,?,?,?,?,?,?,?,?,?,?)",
        rows,
    )


@pytest.mark.timeout(300)
def test_the_edge_page_draws_its_trends_with_uplot(
    tmp_path: Path, processes: Processes, browser: WebDriver
) -> None:
    shots = Shots(browser, tmp_path / "screenshots")
    fh = make_fleet_home(tmp_path, edges=(EDGE,))
    try:
        publish_model(fh, 1)
        fh.db.conn.execute("UPDATE edges SET serving=?, state='online' WHERE edge=?", (MODEL, EDGE))
        rng = np.random.default_rng(7)
        _gate_evaluations(fh, rng)
        monitor = Monitor(fh.db, fh.settings.fleet, policy_from(WINDOW, 0.8))
        for k in range(WINDOWS):
            _window(fh, rng, k)
            monitor.tick(START + (k + 1) * HOUR)
        with fh.fleet() as fleet:
            for k in range(WINDOWS):  # operators label a few of each window, afterwards
                for i in (0, 1, 3, 4):
                    fleet.add_label(f"p-{k * WINDOW + i}", "scratch" if i == 0 else "clean", "lena")
        estimates = alert_store.list_estimates(fh.db, edge=EDGE)
        assert len(estimates) == WINDOWS
        assert all(e.mpp is not None and e.rejects is not None for e in estimates)

        home = str(fh.home.root)
        with fh.fleet() as fleet:  # as `fedge console token add lena --role operator`
            token = accounts.add_token(fleet.store, "lena", accounts.parse_role("operator"))
        port = free_port()
        processes.start("console", "console", "--home", home, "--port", str(port))
        wait_until(lambda: port_open(port), 120, "the console to listen")
        base = f"http://127.0.0.1:{port}"
        log_in(browser, base, token)
        browser.get(f"{base}/edges/{EDGE}")
        wait_for(
            browser,
            "the trend charts",
            10,
            lambda d: d.execute_script("return (window.fedgeTrends || []).length") == 2,
        )
        shape = browser.execute_script(
            "return window.fedgeTrends.map(u => ({series: u.series.length - 1, "
            "points: u.data[0].length, lengths: u.data.map(s => s.length), "
            "labels: u.series.slice(1).map(s => s.label)}))"
        )
        assert [c["series"] for c in shape] == [3, 3]
        assert all(c["lengths"] == [WINDOWS] * 4 for c in shape)
        assert shape[0]["labels"] == ["reject rate", "label agreement", "estimated accuracy (MPP)"]
        assert shape[1]["labels"] == ["input drift", "score drift", "significant shift"]
        data = browser.execute_script("return window.fedgeTrends[0].data")
        rejects = data[1]
        assert rejects[0] == pytest.approx(7 / 50) and rejects[-1] == pytest.approx(17 / 50)
        # Agreement as labelled afterwards: all four agree in distribution; under the lamp
        # the reject of image 3 is labelled clean.
        assert data[2] == [1.0] * (WINDOWS // 2) + [0.75] * (WINDOWS // 2)
        assert all(0.0 <= x <= 1.0 for x in data[3])  # the MPP estimate of every window
        drift = browser.execute_script("return window.fedgeTrends[1].data")
        calm = [x for x in drift[1][: WINDOWS // 2] if x is not None]
        # PSI of 50-image windows is noisy in distribution (up to about 1 here); the
        # brighter lamp is far above it.
        assert calm and min(drift[1][WINDOWS // 2 :]) > 4 * max(calm)
        for chart in browser.find_elements(By.CSS_SELECTOR, ".trend canvas"):
            png = base64.b64decode(chart.screenshot_as_base64)
            pixels = np.asarray(Image.open(io.BytesIO(png)).convert("RGB")).reshape(-1, 3)
            background = np.median(pixels, axis=0)
            drawn = np.abs(pixels.astype(int) - background).sum(axis=1) > 60
            assert drawn.mean() > 0.002, "a trend chart's canvas is blank"
            coloured = pixels[drawn]
            # The series' own colours, not only grey axes and grid.
            assert (coloured.max(axis=1) - coloured.min(axis=1) > 60).sum() > 100
        scripts = [e.get_attribute("src") for e in browser.find_elements(By.TAG_NAME, "script")]
        assert f"{base}/static/vendor/uplot/uPlot.iife.min.js" in scripts
        assert all(not s or s.startswith(base) for s in scripts)  # nothing from elsewhere
        browser.execute_script("document.getElementById('trends').scrollIntoView()")
        shots.take("edge-trends")
    finally:
        fh.close()

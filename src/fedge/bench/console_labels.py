"""``fedge bench console``'s labelling figures (issue 30): a station's image on demand,
and an operator labelling with the images shown.

On the console bench's real fleet (manager home with mutual TLS, Mosquitto, ``manager
serve``, the live agent in process with its image endpoint on), the live station scores
``items`` images (kept on it) and an admin's decision allows operator viewing there (a
signed config version the agent applies). Then:

- **image view**: ``GET /edges/{edge}/images/{id}`` on the console, distinct predictions
  in turn: console -> the manager's client certificate over mutual TLS -> the agent's
  endpoint -> back, audited, never stored. Peer: the same fetch from the manager's side
  alone (edge_manager/viewing/client.py, no console, no audit): what the console adds.
- **label**: in a real headless Chromium (Selenium, Debian's chromium-driver), the label
  queue filtered to the live station; per label, from the key press (``2``, Enter) until
  the next item's image is on screen (labels.js records it, window.fedgeLabelMs). Peer:
  the label's POST alone from the same page (fetch, no image): the server's part.

Targets (issue 30): label p95 <= 300 ms, image view p95 <= 500 ms.
"""

import time
from collections.abc import Callable
from typing import Any

import httpx
import numpy as np

from fedge.bench.console_shot import console_browser
from fedge.bench.errors import BenchError
from fedge.bench.inference_setup import png_images
from fedge.console import queue_store
from fedge.console.images import manager_files
from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_manager.fleet.operations import opened
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.viewing import store as viewing_store
from fedge.edge_manager.viewing.client import fetch_image

LABEL_TARGET_MS = 300.0
VIEW_TARGET_MS = 500.0
Progress = Callable[[str], None]


def _stats(ms: list[float]) -> dict[str, float]:
    values = np.array(ms)
    return {
        "p50_ms": round(float(np.percentile(values, 50)), 2),
        "p95_ms": round(float(np.percentile(values, 95)), 2),
        "max_ms": round(float(values.max()), 2),
        "n": len(ms),
    }


def prepare(home: ManagerHome, agent: EdgeAgent, edge: str, items: int) -> list[str]:
    """The live station scores ``items`` images and is allowed operator viewing; returns
    the prediction ids once the manager has them and the agent applied the config."""
    size = agent.settings.image_size
    ids = [
        agent.score_image(png, suffix=".png", source=f"bench:label-{i}").record.prediction_id
        for i, png in enumerate(png_images(items, seed=30, image_size=size))
    ]
    with opened(home) as fleet:
        (pushed,) = fleet.set_viewing([edge], True)
        deadline = time.monotonic() + 60
        while (
            agent.applied_version < pushed.version
            or queue_store.unlabelled_count(fleet.store, edge, "", "") < items
            or not (found := viewing_store.endpoint(fleet.store, edge)) or not found.images_at
        ):  # fmt: skip
            if time.monotonic() > deadline:
                raise BenchError(f"{edge}'s predictions or its viewing config did not settle")
            time.sleep(0.05)
    return ids


def time_views(
    home: ManagerHome, client: httpx.Client, edge: str, agent: EdgeAgent, ids: list[str]
) -> tuple[dict[str, float], dict[str, float]]:
    """Through the console, then the manager's fetch alone, each id once after a warm-up."""
    files = manager_files(home)
    if files is None or agent.images_at is None:
        raise BenchError("the image view needs the fleet's certificates and the agent's endpoint")
    client.get(f"/edges/{edge}/images/{ids[0]}")
    console, direct = [], []
    for prediction_id in ids:
        started = time.perf_counter()
        response = client.get(f"/edges/{edge}/images/{prediction_id}")
        console.append((time.perf_counter() - started) * 1000)
        if response.status_code != 200 or not response.content.startswith(b"\x89PNG"):
            raise BenchError(f"image view of {prediction_id}: {response.status_code}")
        started = time.perf_counter()
        fetch_image(files, edge, agent.images_at, prediction_id)
        direct.append((time.perf_counter() - started) * 1000)
    return _stats(console), _stats(direct)


def time_labels(
    base: str, token: str, edge: str, labels: int, progress: Progress
) -> tuple[dict[str, float], dict[str, float]]:
    """``labels`` labels by keyboard in Chromium, each until the next image shows; then
    the label POST alone from the page, as many times."""
    with console_browser(base, token, "the label figure") as driver:
        # Importable here: console_browser has checked that Selenium is installed.
        from selenium.webdriver.common.action_chains import ActionChains
        from selenium.webdriver.common.by import By
        from selenium.webdriver.common.keys import Keys
        from selenium.webdriver.support.ui import WebDriverWait

        driver.get(f"{base}/labels?edge={edge}&order=newest")
        shown = "#queue tr.focused figure.station-image.shown img"
        WebDriverWait(driver, 15).until(lambda d: d.find_elements(By.CSS_SELECTOR, shown))
        progress(f"labelling {labels} items by keyboard in chromium")
        for n in range(1, labels + 1):
            ActionChains(driver).send_keys("2").send_keys(Keys.ENTER).perform()
            WebDriverWait(driver, 15, poll_frequency=0.01).until(_labelled(str(n)))
        label_ms = [float(ms) for ms in driver.execute_script("return window.fedgeLabelMs")]
        post_ms = driver.execute_async_script(_POSTS, labels)
    if not isinstance(post_ms, list) or len(label_ms) != labels:
        raise BenchError(f"the page recorded {len(label_ms)} of {labels} labels")
    return _stats(label_ms), _stats([float(ms) for ms in post_ms])


def _labelled(count: str) -> Callable[[Any], bool]:
    """Whether the page's body says ``count`` labels were given (labels.js)."""

    def done(driver: Any) -> bool:
        return bool(driver.find_element("tag name", "body").get_attribute("data-labelled") == count)

    return done


# The label's POST alone, from the page (same session, CSRF, server checks), relabelling
# the items just labelled alternately clean / scratch so each one is a real change.
_POSTS = """
const [count, done] = [arguments[0], arguments[arguments.length - 1]];
const rows = Array.from(document.querySelectorAll('#queue tr.labelled')).slice(0, count);
const times = [];
(async () => {
  for (let i = 0; i < count; i += 1) {
    const form = rows[i % rows.length].querySelector('form');
    const body = new URLSearchParams(new FormData(form));
    body.set('label', i % 2 ? 'scratch' : 'clean');
    const started = performance.now();
    const response = await fetch(form.action, {method: 'POST', body: body,
      headers: {'x-fedge-fetch': '1'}, credentials: 'same-origin'});
    await response.json();
    times.push(performance.now() - started);
  }
  done(times);
})();
"""


def figures(
    view: dict[str, float],
    direct: dict[str, float],
    label: dict[str, float],
    post: dict[str, float],
) -> dict[str, Any]:
    """The labelling part of the console bench's JSON."""
    return {
        "label_p95_ms": label["p95_ms"],
        "label_p50_ms": label["p50_ms"],
        "image_view_p95_ms": view["p95_ms"],
        "image_view_p50_ms": view["p50_ms"],
        "label": label,
        "peer_label_post": post,
        "label_vs_post_p95": round(label["p95_ms"] / post["p95_ms"], 2),
        "image_view": view,
        "peer_station_fetch": direct,
        "image_view_vs_station_fetch_p95": round(view["p95_ms"] / direct["p95_ms"], 2),
    }

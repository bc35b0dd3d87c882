"""The chaos run's load: stations scoring and labelling, an operator changing the fleet.

:class:`StationLoad` plays a station's software and camera: it POSTs images to the
agent's local API (``/v1/score``), labels some of the predictions it got back
(``/v1/labels``) and drops PNG files into the agent's watched inbox. Failures (the agent
is down, its disk is full) are expected under chaos and only counted; what the agent
*acknowledged* is remembered, so the end check can prove each acknowledged prediction
and label was kept.

:class:`OperatorLoad` plays the operator: threshold pushes and deployments through the
manager's library API (:class:`~fedge.edge_manager.fleet.operations.Fleet`), written to the store
whether or not ``manager serve`` is up at that moment -- as an operator's CLI would.
"""

import io
import json
import logging
import os
import random
import threading
import urllib.error
import urllib.request
from collections import Counter
from collections.abc import Sequence

import numpy as np
from PIL import Image

from fedge.bench.chaos.plant import MODEL_NAME, ChaosPlant, Station

log = logging.getLogger(__name__)

HTTP_TIMEOUT_S = 10.0


def png_pool(seed: int, count: int = 32, size: int = 32) -> list[bytes]:
    """``count`` small grayscale PNGs (scoring needs bytes, not meaning)."""
    rng = np.random.default_rng(seed)
    pool = []
    for _ in range(count):
        buffer = io.BytesIO()
        Image.fromarray((rng.random((size, size)) * 255).astype(np.uint8)).save(buffer, "PNG")
        pool.append(buffer.getvalue())
    return pool


def _post(url: str, body: bytes, headers: dict[str, str]) -> dict[str, object]:
    request = urllib.request.Request(url, data=body, headers=headers, method="POST")
    with urllib.request.urlopen(request, timeout=HTTP_TIMEOUT_S) as response:
        reply: dict[str, object] = json.loads(response.read())
    return reply


class StationLoad(threading.Thread):
    def __init__(
        self,
        station: Station,
        images: Sequence[bytes],
        seed: int,
        *,
        api_per_s: float = 4.0,
        files_per_s: float = 1.0,
        label_share: float = 0.25,
    ) -> None:
        super().__init__(name=f"load-{station.edge}", daemon=True)
        self.station = station
        self.images = images
        self.rng = random.Random(seed)
        self.interval_s = 1.0 / (api_per_s + files_per_s)
        self.file_share = files_per_s / (api_per_s + files_per_s)
        self.label_share = label_share
        self.halt = threading.Event()
        self.counters: Counter[str] = Counter()
        # What the agent acknowledged: prediction ids (by source) and label ids.
        self.acked_predictions: dict[str, str] = {}
        self.acked_labels: dict[str, str] = {}
        self.dropped_files: list[str] = []
        self._n = 0

    def run(self) -> None:
        base = f"http://127.0.0.1:{self.station.http_port}"
        while not self.halt.wait(self.interval_s):  # pacing the camera, not a state wait
            self._n += 1
            try:
                if self.rng.random() < self.file_share:
                    self._drop_file()
                elif self.acked_predictions and self.rng.random() < self.label_share:
                    self._label(base)
                else:
                    self._score(base)
            except urllib.error.HTTPError as exc:
                self.counters[f"http_{exc.code}"] += 1
            except (OSError, ValueError) as exc:
                # Refused (agent down), reset mid-request (killed), ENOSPC on staging, ...
                self.counters[f"error.{type(exc).__name__}"] += 1

    def _score(self, base: str) -> None:
        source = f"api:{self.station.edge}:{self._n:07d}"
        reply = _post(
            f"{base}/v1/score",
            self.rng.choice(self.images),
            {"Content-Type": "image/png", "X-Source": source},
        )
        self.acked_predictions[source] = str(reply["prediction_id"])
        self.counters["scored"] += 1

    def _label(self, base: str) -> None:
        prediction_id = self.rng.choice(list(self.acked_predictions.values()))
        label = self.rng.choice(("clean", "scratch"))
        body = json.dumps({"prediction_id": prediction_id, "label": label, "who": "chaos"})
        reply = _post(f"{base}/v1/labels", body.encode(), {"Content-Type": "application/json"})
        self.acked_labels[str(reply["label_id"])] = prediction_id
        self.counters["labelled"] += 1

    def _drop_file(self) -> None:
        """Write beside the inbox, then rename in: the watcher never sees half a file."""
        name = f"{self.station.edge}-{self._n:07d}.png"
        staging = self.station.data_dir / ".staging"
        staging.mkdir(exist_ok=True)
        staged = staging / name
        try:
            staged.write_bytes(self.rng.choice(self.images))
        except OSError:
            staged.unlink(missing_ok=True)
            raise
        self.station.inbox.mkdir(exist_ok=True)
        os.replace(staged, self.station.inbox / name)
        self.dropped_files.append(name)
        self.counters["dropped"] += 1


class OperatorLoad(threading.Thread):
    """Threshold pushes and deployments at a seeded pace, recorded for the report."""

    def __init__(
        self, plant: ChaosPlant, versions: Sequence[int], seed: int, every_s: float = 6.0
    ) -> None:
        super().__init__(name="operator", daemon=True)
        self.plant = plant
        self.versions = list(versions)
        self.rng = random.Random(seed)
        self.every_s = every_s
        self.halt = threading.Event()
        self.counters: Counter[str] = Counter()
        self.errors: list[str] = []

    def run(self) -> None:
        edges = self.plant.edges
        # One store connection for this thread (sqlite objects stay on their thread).
        with self.plant.fleet() as fleet:
            while not self.halt.wait(self.rng.uniform(0.5, 1.5) * self.every_s):
                chosen = self.rng.sample(edges, self.rng.randint(1, len(edges)))
                try:
                    if self.rng.random() < 0.6:
                        threshold = round(self.rng.uniform(0.3, 0.9), 3)
                        fleet.set_threshold(chosen, threshold)
                        self.counters["threshold_pushes"] += 1
                    else:
                        version = self.rng.choice(self.versions)
                        fleet.deploy(MODEL_NAME, version, chosen)
                        self.counters["deployments"] += 1
                except Exception as exc:  # a locked store under load: counted, not fatal
                    self.counters["errors"] += 1
                    self.errors.append(f"{type(exc).__name__}: {exc}"[:300])
                    log.warning("operator change failed: %s", exc)

"""The station's side of thumbnails: when one is made, how small, and that turning sharing
off stops what was queued (real Pillow, SQLite and signed configs; no broker)."""

import io
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
from conftest import PNG_2X2, FleetHome, make_fleet_home
from PIL import Image

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.inference.thumbnails import ThumbnailSharer, admit, make_thumbnail
from fedge.edge_agent.store import LocalStore
from fedge.protocols import codec
from fedge.protocols.records import PredictionRecord, RecordBatch, Stream
from fedge.protocols.thumbnails import (
    MAX_PNG_BYTES,
    PER_BATCH,
    ThumbnailPolicy,
    ThumbnailRecord,
    png_size,
)

POLICY = ThumbnailPolicy(size=48, rejects_only=True, per_minute=3)


def _prediction(n: int, decision: str = "reject", at: float = 1000.0) -> PredictionRecord:
    return PredictionRecord(
        prediction_id=f"p-{n}",
        at=at,
        model="inspect:1",
        scores={"clean": 0.2, "scratch": 0.8},
        decision=decision,
        threshold=0.5,
        config_version=2,
        latency_ms=1.0,
    )


def _image(width: int, height: int, mode: str = "RGB", seed: int = 0) -> bytes:
    pixels = np.random.default_rng(seed).integers(0, 256, (height, width, len(mode)), np.uint8)
    out = io.BytesIO()
    Image.fromarray(pixels.squeeze() if mode == "L" else pixels, mode).save(out, "PNG")
    return out.getvalue()


def test_only_a_policy_shares_and_only_what_it_covers() -> None:
    assert not admit(None, "reject", [], 0.0)
    assert admit(POLICY, "reject", [], 0.0)
    assert not admit(POLICY, "accept", [], 0.0)
    assert admit(ThumbnailPolicy(rejects_only=False), "accept", [], 0.0)
    # At most per_minute in the last minute; older sends no longer count.
    assert not admit(POLICY, "reject", [10.0, 20.0, 30.0], 40.0)
    assert admit(POLICY, "reject", [10.0, 20.0, 30.0], 70.5)


@pytest.mark.parametrize(("width", "height", "mode"), [(512, 384, "RGB"), (300, 900, "L")])
def test_a_thumbnail_is_a_small_png_within_the_bounds(width: int, height: int, mode: str) -> None:
    png = make_thumbnail(_image(width, height, mode), 96)
    assert png is not None and len(png) <= MAX_PNG_BYTES
    side = max(png_size(png))
    # Noise compresses badly: a colour one falls back to grey, then to a smaller size.
    assert 16 <= side <= 96
    assert max(png_size(make_thumbnail(_image(40, 20), 64) or b"")) == 40  # never enlarged


def test_what_is_not_an_image_gives_no_thumbnail() -> None:
    assert make_thumbnail(b"not an image", 64) is None
    assert make_thumbnail(b"", 64) is None


def test_the_sharer_queues_within_the_cap_and_counts_the_rest(tmp_path: Path) -> None:
    store, counters = LocalStore(tmp_path / "agent.db"), Counter[str]()
    sharer = ThumbnailSharer(store, counters)
    image = _image(128, 128, "L")
    assert not sharer.offer(None, _prediction(0), image)  # no policy: nothing, not counted
    assert not sharer.offer(POLICY, _prediction(1, "accept"), image)
    shared = [sharer.offer(POLICY, _prediction(n, at=1000.0 + n), image) for n in range(2, 7)]
    assert shared == [True, True, True, False, False]
    assert counters == Counter({"thumbnails.queued": 3, "thumbnails.capped": 2})
    assert sharer.offer(POLICY, _prediction(9, at=1063.0), image)  # a minute later
    assert not sharer.offer(POLICY, _prediction(10, at=1064.0), b"broken")
    assert counters["thumbnails.failed"] == 1
    assert store.backlog()["pending_records"] == 4
    store.close()


def test_thumbnails_are_sealed_a_few_to_a_batch(tmp_path: Path) -> None:
    store = LocalStore(tmp_path / "agent.db")
    for n in range(PER_BATCH * 2 + 1):
        store.add_record(Stream.THUMBNAILS, ThumbnailRecord(f"p-{n}", 1.0, PNG_2X2))
    assert store.seal_batches("st-01", 1, max_records=500) == 3
    batches = [codec.decode(e.payload, RecordBatch) for e in store.outbox(10, set())]
    assert [len(b.records) for b in batches] == [PER_BATCH, PER_BATCH, 1]
    assert [b.seq for b in batches] == [0, 1, 2]
    store.close()


@pytest.fixture
def fh(tmp_path: Path) -> FleetHome:
    return make_fleet_home(tmp_path, edges=("st-01",))


def _signed_config(fh: FleetHome, policy: ThumbnailPolicy | None) -> bytes:
    with fh.fleet() as fleet:
        fleet.set_thumbnails(["st-01"], policy)
    row = fh.row(
        "SELECT envelope FROM desired WHERE edge='st-01' AND kind='config' "
        "ORDER BY version DESC LIMIT 1"
    )
    return str(row["envelope"]).encode()


def test_turning_sharing_off_drops_the_thumbnails_not_yet_sent(fh: FleetHome) -> None:
    # The agent is not started: nothing seals or sends, so what is queued stays queued.
    agent = EdgeAgent(fh.agent_settings("st-01"))
    try:
        agent.configs.handle(_signed_config(fh, POLICY))
        assert agent.config is not None and agent.config.thumbnails == POLICY
        for n in range(3):
            agent.store.add_record(Stream.THUMBNAILS, ThumbnailRecord(f"p-{n}", 1.0, PNG_2X2))
        agent.store.add_record(Stream.PREDICTIONS, _prediction(7))
        agent.configs.handle(_signed_config(fh, None))
        assert agent.config is not None and agent.config.thumbnails is None
        assert agent.counters["thumbnails.dropped"] == 3
        # Only the prediction is left to send.
        assert agent.store.backlog()["pending_records"] == 1
    finally:
        agent.store.close()
    fh.close()

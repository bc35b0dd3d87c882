"""The gate's evaluations on a station (no broker: the agent's publishes are captured).

Models already on the station are hard-linked into the evaluation's own directory and
verified there, so these tests need no download; the download path is exercised by
``tests/test_gate_flow.py`` against a real manager.
"""

import dataclasses
import functools
import io
import shutil
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FLEET, FleetHome, make_fleet_home, publish_model
from PIL import Image

from fedge.edge_agent.agent import EdgeAgent
from fedge.edge_agent.deploy import deployer
from fedge.edge_agent.inference.evaluations import (
    LAST_REPORT_KEY,
    REPORT_MAX_BYTES,
    WORK_DIR,
    fit_report,
)
from fedge.edge_manager.registry.versions import PublishedModel
from fedge.monitoring.features import IMAGE_STATS
from fedge.party.station_store import is_holdout
from fedge.protocols import codec, topics
from fedge.protocols.evaluation import (
    DEFAULT_AUGMENT,
    MAX_IMAGES,
    EvaluationItem,
    EvaluationReport,
    EvaluationRequest,
    EvaluationStatus,
)
from fedge.protocols.signing import SigningKey

EDGE = "st-01"
Sent = list[tuple[str, bytes]]


@pytest.fixture
def fh(tmp_path: Path) -> Iterator[FleetHome]:
    fleet_home = make_fleet_home(tmp_path, edges=(EDGE, "st-02"))
    fleet_home.set_agent_option(EDGE, "holdout_percent", 90)
    yield fleet_home
    fleet_home.close()


def start_agent(fh: FleetHome, sent: Sent, monkeypatch: pytest.MonkeyPatch) -> EdgeAgent:
    agent = EdgeAgent(fh.agent_settings(EDGE))

    def publish(topic: str, payload: bytes, *args: Any, **kwargs: Any) -> None:
        sent.append((topic, payload))

    monkeypatch.setattr(agent.mqtt, "publish", publish)
    return agent


@pytest.fixture
def sent() -> Sent:
    return []


@pytest.fixture
def agent(fh: FleetHome, sent: Sent, monkeypatch: pytest.MonkeyPatch) -> Iterator[EdgeAgent]:
    edge_agent = start_agent(fh, sent, monkeypatch)
    try:
        yield edge_agent
    finally:
        edge_agent.store.close()
        edge_agent.station.close()


def on_station(fh: FleetHome, model: PublishedModel) -> None:
    """Put a published model where a deployment leaves it on the station."""
    target = fh.data_dir(EDGE) / "models" / "inspect" / str(model.manifest.version) / "model.onnx"
    target.parent.mkdir(parents=True, exist_ok=True)
    shutil.copyfile(model.path, target)


def keep_labelled(agent: EdgeAgent, count: int) -> list[str]:
    """``count`` held-out labelled images on the station (and one that is not held out)."""
    rng = np.random.default_rng(0)
    ids: list[str] = []
    index = 0
    while len(ids) < count:
        pid = f"p-{index:04d}"
        index += 1
        buffer = io.BytesIO()
        Image.fromarray((rng.random((32, 32)) * 255).astype(np.uint8)).save(buffer, "PNG")
        agent.station.keep(pid, buffer.getvalue(), ".png")
        agent.station.label(pid, "scratch" if index % 2 else "clean")
        if is_holdout(pid, 90):
            ids.append(pid)
    return ids


def request(
    fh: FleetHome,
    models: list[PublishedModel],
    version: int = 1,
    edge: str = EDGE,
    augment: int | None = None,
) -> EvaluationRequest:
    return EvaluationRequest(
        FLEET, edge, version, f"ev-{version}", tuple(m.envelope.decode() for m in models),
        "127.0.0.1:1", 50, 1.0, augment,
    )  # fmt: skip


def reports(sent: Sent) -> list[EvaluationReport]:
    topic = topics.up(FLEET, EDGE, topics.Up.EVALUATE)
    return [codec.decode(payload, EvaluationReport) for t, payload in sent if t == topic]


def test_the_station_scores_its_held_out_images_with_each_model(
    fh: FleetHome, agent: EdgeAgent, sent: Sent, monkeypatch: pytest.MonkeyPatch
) -> None:
    serving, candidate = publish_model(fh, 1, seed=1), publish_model(fh, 2, seed=2)
    on_station(fh, serving)
    on_station(fh, candidate)
    held_out = keep_labelled(agent, 12)
    ask = request(fh, [candidate, serving])
    agent.evaluations.evaluate(ask)

    (report,) = reports(sent)
    assert (report.status, report.eval_id, report.version) == (EvaluationStatus.DONE, "ev-1", 1)
    assert report.holdout == 12
    # Each image as it is and as DEFAULT_AUGMENT re-lit copies, by each model.
    assert {(i.prediction_id, i.model, i.augmented) for i in report.items} == {
        (pid, ref, copy)
        for pid in held_out
        for ref in ("inspect:1", "inspect:2")
        for copy in (None, *range(1, DEFAULT_AUGMENT + 1))
    }
    for item in report.items:
        assert set(item.stats) == set(IMAGE_STATS)
        assert set(item.scores) == {"clean", "scratch"}
    by_key = {(i.prediction_id, i.model, i.augmented): i for i in report.items}
    for pid in held_out:
        original = by_key[(pid, "inspect:1", None)]
        for copy in range(1, DEFAULT_AUGMENT + 1):
            relit = by_key[(pid, "inspect:1", copy)]
            assert relit.label == original.label  # re-lighting keeps the label
            assert relit.stats != original.stats  # ... and changes the image
            # Both models score the same copy (seeded by the image and the copy).
            assert by_key[(pid, "inspect:2", copy)].stats == relit.stats
    # Nothing activated, nothing left behind; the station's models are untouched.
    assert agent.serving == ""
    assert not (fh.data_dir(EDGE) / WORK_DIR).exists()
    assert (fh.data_dir(EDGE) / "models" / "inspect" / "2" / "model.onnx").is_file()
    assert agent.counters["evaluate.done"] == 1

    # The same request again (a retained copy): stale, not evaluated twice.
    envelope = fh.home.signing_key().sign(ask)
    agent.handle_evaluate(envelope)
    assert agent.counters["evaluate.stale"] == 1

    # A restart neither loses the report nor runs the evaluation again.
    agent.store.close()
    agent.station.close()
    again = start_agent(fh, sent, monkeypatch)
    try:
        assert again.evaluations.done_version == 1
        again.serving_state.session = again.store.next_session()  # as its first connection does
        restated = dict(again._statements())
        assert codec.decode(restated[topics.Up.EVALUATE], EvaluationReport) == report
        assert again._known_versions()["evaluate"] == 1
        again.handle_evaluate(envelope)
        assert again.counters["evaluate.stale"] == 1
        assert len(reports(sent)) == 1
    finally:
        again.store.close()
        again.station.close()


def test_a_request_for_no_copies_gets_the_images_as_they_are(
    fh: FleetHome, agent: EdgeAgent, sent: Sent
) -> None:
    model = publish_model(fh, 1, seed=1)
    on_station(fh, model)
    held_out = keep_labelled(agent, 4)
    agent.evaluations.evaluate(request(fh, [model], augment=0))
    (report,) = reports(sent)
    assert report.status is EvaluationStatus.DONE
    assert sorted((i.prediction_id, i.augmented) for i in report.items) == [
        (pid, None) for pid in sorted(held_out)
    ]


def test_forged_foreign_and_malformed_requests_are_counted_and_ignored(
    fh: FleetHome, agent: EdgeAgent, sent: Sent
) -> None:
    model = publish_model(fh, 1)
    forged = SigningKey.generate().sign(request(fh, [model]))
    foreign = fh.home.signing_key().sign(request(fh, [model], edge="st-02"))
    for envelope in (forged, foreign, b"{not json", b""):
        agent.handle_evaluate(envelope)
    rejected = {k: v for k, v in agent.counters.items() if k.startswith("evaluate.rejected.")}
    assert sum(rejected.values()) == 4, rejected
    assert rejected["evaluate.rejected.bad_signature"] == 1
    assert reports(sent) == []
    assert agent.evaluations.done_version == 0


def test_a_station_without_held_out_labels_reports_failed(
    fh: FleetHome, agent: EdgeAgent, sent: Sent
) -> None:
    model = publish_model(fh, 1)
    agent.evaluations.evaluate(request(fh, [model]))
    (report,) = reports(sent)
    assert report.status is EvaluationStatus.FAILED
    assert report.reason.startswith("no_holdout: this station has no held-out labelled images")
    assert report.items == () and report.holdout == 0
    assert agent.evaluations.done_version == 1


def test_the_report_is_stored_first_and_published_outside_the_evaluation_lock(
    fh: FleetHome, agent: EdgeAgent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Publishing reaches paho and the gRPC poller's lock: never under ours (a deadlock),
    and only after the store write that makes the report survive a crash."""
    seen: list[tuple[bool, str | None]] = []

    def publish(topic: str, payload: bytes, *args: Any, **kwargs: Any) -> None:
        if topic == topics.up(FLEET, EDGE, topics.Up.EVALUATE):
            seen.append((agent.evaluations._lock.locked(), agent.store.get(LAST_REPORT_KEY)))

    monkeypatch.setattr(agent.mqtt, "publish", publish)
    agent.evaluations.evaluate(request(fh, [publish_model(fh, 1)]))
    ((locked, stored),) = seen
    assert not locked
    assert stored is not None and codec.decode(stored.encode(), EvaluationReport).version == 1


def test_models_with_other_classes_are_not_compared(
    fh: FleetHome, agent: EdgeAgent, sent: Sent
) -> None:
    keep_labelled(agent, 2)
    serving = publish_model(fh, 1)
    with fh.fleet() as fleet:
        other = fleet.registry.publish(
            serving.path, name="inspect", version=2, classes=("clean", "dent")
        )
    agent.evaluations.evaluate(request(fh, [other, serving]))
    (report,) = reports(sent)
    assert report.status is EvaluationStatus.FAILED
    assert report.reason.startswith("class_mismatch: inspect:2 has classes clean,dent")


def test_a_failed_download_is_reported(
    fh: FleetHome, agent: EdgeAgent, sent: Sent, monkeypatch: pytest.MonkeyPatch
) -> None:
    """The manifest verifies but no manager answers at the request's gRPC target (one
    attempt here instead of the deployer's retries with back-off)."""
    keep_labelled(agent, 2)
    model = publish_model(fh, 1)
    monkeypatch.setattr(
        deployer, "prepare", functools.partial(deployer.prepare, attempts=1, backoff_s=0.0)
    )
    agent.evaluations.evaluate(request(fh, [model]))
    (report,) = reports(sent)
    assert report.status is EvaluationStatus.FAILED
    assert report.reason.startswith("download_failed: inspect:1:")
    assert not (fh.data_dir(EDGE) / WORK_DIR).exists()


def test_a_report_too_large_drops_its_oldest_images() -> None:
    def item(index: int, model: str) -> EvaluationItem:
        return EvaluationItem(f"p-{index:04d}", model, "clean", {"clean": 0.5, "scratch": 0.5})

    per_image = [(item(i, "inspect:1"), item(i, "inspect:2")) for i in range(100)]
    base = EvaluationReport("st-01", "ev-1", 1, EvaluationStatus.DONE, holdout=100)
    fitted = fit_report(base, per_image, 5000)
    assert len(codec.encode(fitted)) <= 5000
    kept = sorted({i.prediction_id for i in fitted.items})
    assert 0 < len(kept) < 100 and kept[-1] == "p-0099"  # the newest stay
    assert all(len([i for i in fitted.items if i.prediction_id == pid]) == 2 for pid in kept)


def test_a_report_too_large_loses_re_lit_copies_before_images() -> None:
    stats = dict.fromkeys(IMAGE_STATS, 0.123456)

    def pid(index: int) -> str:
        return f"p-{index:04d}{'0' * 28}"  # as long as an agent's ids (p-<uuid4 hex>)

    def items(index: int) -> tuple[EvaluationItem, ...]:
        return tuple(
            EvaluationItem(pid(index), model, "clean", {"clean": 0.5, "scratch": 0.5}, stats, copy)
            for model in ("inspect:1", "inspect:2")
            for copy in (None, 1, 2)
        )

    per_image = [items(i) for i in range(MAX_IMAGES)]
    base = EvaluationReport("st-01", "ev-1", 1, EvaluationStatus.DONE, holdout=MAX_IMAGES)
    everything = dataclasses.replace(base, items=tuple(i for image in per_image for i in image))
    limit = REPORT_MAX_BYTES
    assert len(codec.encode(everything)) > limit  # 1200 items do not fit
    fitted = fit_report(base, per_image, limit)
    assert len(codec.encode(fitted)) <= limit
    originals = [i for i in fitted.items if i.augmented is None]
    copied = sorted({i.prediction_id for i in fitted.items if i.augmented is not None})
    assert len(originals) == 2 * MAX_IMAGES  # every image as it is stays
    assert 0 < len(copied) < MAX_IMAGES
    assert copied == [pid(i) for i in range(MAX_IMAGES - len(copied), MAX_IMAGES)]  # newest
    for name in copied:  # an image's copies go together
        assert len([i for i in fitted.items if i.prediction_id == name]) == 6
    # Room for one image only: its copies are left out before it is.
    newest_as_is = tuple(i for i in per_image[-1] if i.augmented is None)
    room = len(codec.encode(dataclasses.replace(base, items=newest_as_is))) + 10
    tiny = fit_report(base, per_image, room)
    assert [(i.prediction_id, i.augmented) for i in tiny.items] == [(pid(MAX_IMAGES - 1), None)] * 2

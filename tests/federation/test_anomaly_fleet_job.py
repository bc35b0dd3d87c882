"""An anomaly fleet job on real SuperNodes: prepared, signed, run by the job runner, published.

Real processes: the fleet's SuperLink, one ``flower-supernode`` per station started by the
agent's own supervisor (:mod:`fedge.edge_agent.training.supervisor`) on the station's data
directory (a real SQLite store and PNG files), trusting only apps the manager signed;
fedge's fleet ServerApp and the stations' anomaly ClientApp, submitted with ``flwr run``
(:func:`fedge.federation.fleet_job.submit`). The job's one round goes through the job
runner like any fleet job. Shown (issue 28):

- each station's good parts are counted once: the run store's ``num-examples`` per station
  equal the parts its operators labelled good in its training split;
- each station reports its threshold from its held-out good parts and its training parts,
  each scored under the fleet's fit without it;
- the published model is signed by the manager, scores ``score``/``anomaly_map`` in ONNX
  Runtime, equals the fit on the pooled good parts, and scores held-out dents above the
  held-out good parts at every station.

The same job under ``[privacy] secagg = true`` runs its round through Flower's SecAgg+
(the anomaly ClientApp behind ``secagg_mod``): each station's count is in the clear, its
moments only in the masked sum, and the fitted model is within the bound
:func:`fedge.aggregator.anomaly.secure.fit_bounds` states of the pooled fit (and, being
quantised, not equal to it to float64 rounding). Under ``[privacy] mode = "local"`` each
station releases its statistics once by the Gaussian mechanism, recorded in its own
ledger, and a station whose floor allows less than the job asks refuses.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

import numpy as np
import onnxruntime as ort
import pytest
from conftest import FleetHome, make_fleet_home, png_bytes, publish_trainable

from fedge.aggregator.anomaly.rounds import fleet_fit, read_thresholds
from fedge.aggregator.anomaly.secure import fit_bounds, secagg_privacy
from fedge.aggregator.fleet.server import FLEET_MAX_WEIGHT
from fedge.aggregator.jobs.checkpoint import load_arrays
from fedge.aggregator.jobs.run_store import RunStore
from fedge.aggregator.superlink.link import SuperLink
from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.edge_agent.training.supervisor import SupernodeSpec, SupernodeSupervisor
from fedge.federation import fleet_job
from fedge.federation.prepare import prepare
from fedge.federation.publish import publish
from fedge.models.anomaly.backbone import InspectionBackbone
from fedge.models.anomaly.model import extract_features
from fedge.models.anomaly.private import clip_features
from fedge.models.anomaly.statistics import fit, station_statistics
from fedge.models.inspection import INPUT_NAME, new_model
from fedge.party import trainer
from fedge.party.budget import BudgetLedger
from fedge.party.privacy_status import ledger_path
from fedge.party.station_store import Retention, StationData
from fedge.privacy.floor import PrivacyFloor
from fedge.privacy.settings import PrivacySpec
from fedge.protocols import signing
from fedge.protocols.manifest import ModelManifest, Preprocess

pytestmark = pytest.mark.integration

STATIONS = {"st-01": 40, "st-02": 24, "st-03": 12}  # images kept, a quarter defects
HOLDOUT = 20
JOB = """
[job]
name = "normal-parts"
rounds = 1

[task]
model = "inspect:1"
family = "anomaly"

[anomaly]
false_alarm_rate = 0.25  # a conformal threshold at 25 % rests on 3 good parts

[federation]
backend = "fleet"
fleet = "plant-a"
edges = "all"
node_wait_s = 90.0
round_timeout_s = 240.0
eval_timeout_s = 240.0
"""


def keep_parts(data_dir: Path, edge: str, n: int, seed: int) -> None:
    data = StationData(data_dir, Retention(holdout_percent=HOLDOUT))
    images, labels = make_defect_images(n, seed=seed, scratch_fraction=0.25)
    for index, (image, label) in enumerate(zip(images, labels, strict=True)):
        pid = f"{edge}-{index:03d}"
        data.keep(pid, png_bytes(image), ".png", at=time.time() + index)
        data.label(pid, CLASSES[int(label)], at=float(index))
    data.close()


def good_parts(data_dir: Path, *, holdout: bool) -> np.ndarray:
    data = StationData(data_dir, Retention(holdout_percent=HOLDOUT), readonly=True)
    try:
        chosen = [i for i in data.labelled() if i.label == "clean" and i.holdout == holdout]
    finally:
        data.close()
    return trainer.load_examples(chosen, ("clean",), Preprocess(32)).x


@contextmanager
def fleet_running(
    tmp_path: Path,
    supervisors: list[SupernodeSupervisor],
    stations: dict[str, int],
    job: str,
    *,
    seed: int,
    before_start: Callable[[FleetHome], None] | None = None,
) -> Iterator[tuple[FleetHome, Path]]:
    """A fleet whose stations keep ``stations[edge]`` labelled parts (seeds from ``seed``),
    each running a SuperNode against a local SuperLink, with ``job`` prepared and
    submitted: yields the fleet's home and the job's folder. The processes' logs are
    printed when the body fails."""
    fh: FleetHome = make_fleet_home(tmp_path, edges=tuple(stations))
    publish_trainable(fh, tmp_path, tuple(stations))
    for index, (edge, n) in enumerate(stations.items()):
        keep_parts(fh.data_dir(edge), edge, n, seed=seed + index)
    if before_start is not None:
        before_start(fh)
    superlink = SuperLink(tmp_path / "superlink", "127.0.0.1", fh.settings.superlink_port)
    superlink.start()
    try:
        for edge in stations:
            supervisor = SupernodeSupervisor(fh.data_dir(edge) / "supernode")
            supervisors.append(supervisor)
            supervisor.start()
            supervisor.apply(
                SupernodeSpec(
                    superlink.address, edge, fh.data_dir(edge), HOLDOUT, 1, 120.0,
                    trusted_entities=signing_yaml(fh),
                )
            )  # fmt: skip
        manifest = tmp_path / "job.toml"
        manifest.write_text(job, encoding="utf-8")
        job_dir = tmp_path / "job"
        prepare(manifest, job_dir, fh.home)
        fleet_job.submit(
            job_dir,
            superlink.local_address,
            signing=(fh.home.signing_key(), superlink.signed_apps),
        )
        yield fh, job_dir
    except BaseException:
        for log in sorted(tmp_path.rglob("*.log")):
            print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        superlink.stop()
        fh.close()


def counted_parts(job_dir: Path, run_id: str) -> tuple[dict[str, int], dict[str, Any]]:
    """Each station's reported count (``num-examples``) and the job's one round."""
    store = RunStore(job_dir / "runs.db")
    try:
        names = store.party_names(run_id)
        counted = {
            names[int(r["party"])]: int(r["metrics"]["num-examples"])
            for r in store.party_metrics(run_id)
        }
        (round_1,) = store.rounds(run_id)
    finally:
        store.close()
    return counted, round_1


@pytest.mark.timeout(900)
def test_an_anomaly_fleet_job_counts_each_station_once_and_publishes_a_signed_model(
    tmp_path: Path, supervisors: list[SupernodeSupervisor]
) -> None:
    started = time.monotonic()
    with fleet_running(tmp_path, supervisors, STATIONS, JOB, seed=70) as (fh, job_dir):
        assert (
            'clientapp = "fedge.party.anomaly_app:app"'
            in (job_dir / "app" / "pyproject.toml").read_text()
        )
        result = fleet_job.wait(job_dir, timeout_s=400)
        assert result.state.value == "completed", result.error
        print(f"anomaly fleet job: {time.monotonic() - started:.1f} s")

        # Every station's good training parts counted once, in the run store.
        counted, round_1 = counted_parts(job_dir, result.run_id)
        expected = {e: len(good_parts(fh.data_dir(e), holdout=False)) for e in STATIONS}
        assert all(n > 0 for n in expected.values()), expected
        assert counted == expected
        assert round_1["failed"] == [], round_1

        # Each station's threshold rests on its held-out good parts and on its good
        # training parts, each scored under the fleet's fit without it (the job sends the
        # pooled sums): a station with fewer held out than a 25 % threshold needs (3)
        # still sets one.
        held_out = {e: len(good_parts(fh.data_dir(e), holdout=True)) for e in STATIONS}
        thresholds = read_thresholds(job_dir)
        assert sorted(thresholds) == sorted(STATIONS)
        assert any(n < 3 for n in held_out.values()), held_out  # what the sums are for
        for edge, n in held_out.items():
            reported = thresholds[edge]
            assert reported["threshold"] > 0, edge
            assert reported["holdout_examples"] == n
            assert reported["calibration_examples"] == n + expected[edge]
            assert reported["calibration_false_alarms"] <= 0.25 * (n + expected[edge])

        # The fleet's model is the fit on the pooled good parts.
        backbone = InspectionBackbone(new_model(0, width=4)).eval()
        pooled_images = np.concatenate(
            [good_parts(fh.data_dir(e), holdout=False) for e in STATIONS]
        )
        pooled = fit(station_statistics(*extract_features(backbone, pooled_images)))
        model = fleet_fit(load_arrays(job_dir / "final.npz"))
        assert model.count == sum(expected.values())
        np.testing.assert_allclose(model.mean, pooled.mean, rtol=0, atol=1e-9)
        np.testing.assert_allclose(model.covariance, pooled.covariance, rtol=0, atol=1e-9)

        # Published once, signed by the manager, with lineage.
        ref = publish(job_dir, fh.home)
        assert ref == "inspect-anomaly:1"
        assert publish(job_dir, fh.home) == ref
        with fh.fleet() as fleet:
            published = fleet.registry.get("inspect-anomaly", 1)
        keys = signing.trusted(fh.home.signing_key().public)
        assert signing.open_signed(published.envelope, ModelManifest, keys) == published.manifest
        assert published.manifest.lineage.run_id == result.run_id
        assert [o.name for o in published.manifest.outputs] == ["score", "anomaly_map"]

        # The published model: a held-out dent scores above the held-out good parts.
        session = ort.InferenceSession(str(published.path), providers=["CPUExecutionProvider"])
        for seed, edge in enumerate(STATIONS):
            good = good_parts(fh.data_dir(edge), holdout=True)
            if len(good) == 0:  # a station that held none out: fresh good parts of its line
                images, _ = make_defect_images(8, seed=800 + seed, scratch_fraction=0.0)
                good = images.astype(np.float32)[:, None] / 255.0
            dents, _ = make_defect_images(
                8, seed=900 + seed, scratch_fraction=1.0, dent_fraction=1.0
            )
            good_scores = score(session, good)
            dent_scores = score(session, dents.astype(np.float32)[:, None] / 255.0)
            print(edge, np.round(good_scores, 1), np.round(dent_scores, 1))
            # The backbone is an untrained inspection CNN and the fleet holds ~50 good
            # parts: dents stand out in the bulk, not each one above every good part.
            assert np.median(dent_scores) > np.percentile(good_scores, 75), edge


SECURE_STATIONS = {"st-01": 16, "st-02": 12, "st-03": 10}
CLIP = 2.0  # the untrained backbone's feature norms: median 0.64, 99th percentile 2.7
SECURE_JOB = (
    JOB.replace("[anomaly]\n", f"[anomaly]\nclip = {CLIP}\n")
    .replace("[federation]", "[privacy]\nsecagg = true\n\n[federation]")
    .replace("round_timeout_s = 240.0", "round_timeout_s = 120.0")
)


@pytest.mark.timeout(600)
def test_an_anomaly_round_through_secagg_is_within_the_stated_bound_of_the_pooled_fit(
    tmp_path: Path, supervisors: list[SupernodeSupervisor]
) -> None:
    started = time.monotonic()
    with fleet_running(tmp_path, supervisors, SECURE_STATIONS, SECURE_JOB, seed=40) as (
        fh,
        job_dir,
    ):
        result = fleet_job.wait(job_dir, timeout_s=300)
        assert result.state.value == "completed", result.error
        print(f"SecAgg+ anomaly fleet job: {time.monotonic() - started:.1f} s")

        counted, round_1 = counted_parts(job_dir, result.run_id)
        expected = {e: len(good_parts(fh.data_dir(e), holdout=False)) for e in SECURE_STATIONS}
        assert counted == expected  # the counts travel in the clear, each once
        assert round_1["failed"] == [], round_1

        backbone = InspectionBackbone(new_model(0, width=4)).eval()
        pooled_images = np.concatenate(
            [good_parts(fh.data_dir(e), holdout=False) for e in SECURE_STATIONS]
        )
        features, grid = extract_features(backbone, pooled_images)
        pooled = fit(station_statistics(clip_features(features, CLIP), grid))
        model = fleet_fit(load_arrays(job_dir / "final.npz"))
        assert model.count == pooled.count == sum(expected.values())
        privacy = secagg_privacy(PrivacySpec(secagg=True), clip=CLIP, parties=len(SECURE_STATIONS))
        bounds = fit_bounds(
            list(expected.values()), clip=CLIP, dims=features.shape[2], privacy=privacy,
            max_weight=FLEET_MAX_WEIGHT,
        )  # fmt: skip
        assert round_1["eval_metrics"]["secagg-moment-bound"] == pytest.approx(bounds.moments)
        mean_error = float(np.max(np.abs(model.mean - pooled.mean)))
        covariance_error = float(
            np.max(np.linalg.norm(model.covariance - pooled.covariance, axis=(1, 2)))
        )
        print(f"mean error {mean_error:.3g} (bound {bounds.mean:.3g}), covariance error "
              f"{covariance_error:.3g} (bound {bounds.covariance:.3g})")  # fmt: skip
        assert 1e-12 < mean_error <= bounds.mean  # quantised by SecAgg+, within its bound
        assert covariance_error <= bounds.covariance


PRIVATE_STATIONS = {"st-01": 16, "st-02": 12, "st-03": 10}
JOB_EPSILON, FLOOR_EPSILON = 8.0, 2.0
PRIVATE_JOB = (
    JOB.replace("[anomaly]\n", f"[anomaly]\nclip = {CLIP}\n")
    .replace(
        "[federation]",
        f'[privacy]\nmode = "local"\nepsilon = {JOB_EPSILON}\ndelta = 1e-5\n\n[federation]',
    )
    .replace("round_timeout_s = 240.0", "round_timeout_s = 120.0")
)


@pytest.mark.timeout(600)
def test_a_private_anomaly_round_releases_each_station_once_and_a_floor_refuses_more(
    tmp_path: Path, supervisors: list[SupernodeSupervisor]
) -> None:
    """``[privacy] mode = "local"`` across the process boundary: every station releases
    its statistics once by the Gaussian mechanism and records it in its own ledger,
    within the job's epsilon; a station whose own floor allows less than the job asks
    refuses before computing anything (its error reply is the round's one failure, its
    ledger stays empty) and the fit is of the others' releases; no station reports a
    threshold (a quantile of its held-out scores is no DP release)."""
    floor = PrivacyFloor(job_epsilon=FLOOR_EPSILON, lifetime_epsilon=16.0, delta=1e-5)
    with fleet_running(
        tmp_path,
        supervisors,
        PRIVATE_STATIONS,
        PRIVATE_JOB,
        seed=50,
        before_start=lambda fh: write_floor(fh.data_dir("st-01"), floor),
    ) as (fh, job_dir):
        result = fleet_job.wait(job_dir, timeout_s=300)
        assert result.state.value == "completed", result.error
        counted, round_1 = counted_parts(job_dir, result.run_id)
        store = RunStore(job_dir / "runs.db")
        try:
            names = store.party_names(result.run_id)
            evaluations = store.evaluations(result.run_id)
        finally:
            store.close()
        assert [named(names, p) for p in round_1["failed"]] == ["st-01"], round_1
        assert sorted(counted) == ["st-02", "st-03"]  # noisy counts: part of the release
        ledgers = {}
        for edge in PRIVATE_STATIONS:
            ledger = BudgetLedger(ledger_path(fh.data_dir(edge)))
            try:
                spent = ledger.spent(result.run_id, delta=1e-5)
                ledgers[edge] = (ledger.history(result.run_id), spent)
            finally:
                ledger.close()

        # The floor refused before anything was released: nothing in its ledger.
        assert ledgers["st-01"] == ([], 0.0)
        # One release per other station, accounted to this job, within its epsilon.
        for edge in ("st-02", "st-03"):
            history, spent = ledgers[edge]
            assert len(history) == 1 and history[0].sample_rate == 1.0, (edge, history)
            assert 0.5 * JOB_EPSILON < spent <= JOB_EPSILON + 1e-9, (edge, spent)

        # The fit is of noisy sums: not the fit of those stations' parts, still a usable
        # Gaussian.
        backbone = InspectionBackbone(new_model(0, width=4)).eval()
        released = np.concatenate(
            [good_parts(fh.data_dir(e), holdout=False) for e in ("st-02", "st-03")]
        )
        features, grid = extract_features(backbone, released)
        plain = fit(station_statistics(clip_features(features, CLIP), grid))
        model = fleet_fit(load_arrays(job_dir / "final.npz"))
        assert model.count >= 1 and np.all(np.isfinite(model.mean))
        assert float(np.max(np.abs(model.mean - plain.mean))) > 1e-6  # the noise is there
        np.linalg.cholesky(model.covariance)  # positive definite (clipped, with the ridge)

        # No station reports a threshold under DP or its floor; each says why, and the
        # reason is what the operator is shown.
        thresholds = read_thresholds(job_dir)
        assert sorted(thresholds) == sorted(PRIVATE_STATIONS), thresholds
        assert all("threshold" not in t for t in thresholds.values()), thresholds
        assert all("no anomaly threshold" in t["reason"] for t in thresholds.values())
        assert sorted(named(names, e["party"]) for e in evaluations) == sorted(PRIVATE_STATIONS)
        assert all("no anomaly threshold" in str(e["error"]) for e in evaluations), evaluations


def named(names: dict[int, str], party: object) -> str:
    """A party as the run store gives it (its node id, or its name) -> its name."""
    return names[int(str(party))] if str(party).isdigit() else str(party)


def write_floor(data_dir: Path, floor: PrivacyFloor) -> None:
    """The floor as the station's agent writes it from agent.toml."""
    data_dir.mkdir(parents=True, exist_ok=True)
    ledger = BudgetLedger(ledger_path(data_dir))
    try:
        ledger.set_floor(floor)
    finally:
        ledger.close()


def score(session: ort.InferenceSession, images: np.ndarray) -> np.ndarray:
    (scores,) = session.run(["score"], {INPUT_NAME: images.astype(np.float32)})
    return np.asarray(scores)


def signing_yaml(fh: FleetHome) -> str:
    from fedge.protocols.app_signing import trusted_entities_yaml

    return trusted_entities_yaml(fh.home.signing_key().public)

"""An anomaly job's round is FedAvg of moments: the fold of the stations' replies is the
pooled sums, and the manifest keeps such a job to one round of sums."""

import numpy as np
import pytest
from flwr.app import (
    Array,
    ArrayRecord,
    ConfigRecord,
    Message,
    Metadata,
    MetricRecord,
    RecordDict,
)
from flwr.app.message import make_message
from flwr.supercore.task_identity import TaskIdentity

from fedge.aggregator.anomaly.rounds import BACKBONE_KEY, StatisticsFedAvg, fleet_fit
from fedge.aggregator.fleet.manifest import parse_fleet_manifest
from fedge.aggregator.jobs.directory import JobError
from fedge.aggregator.jobs.spec import ManifestError
from fedge.aggregator.rounds.deadline import RoundPlan
from fedge.aggregator.rounds.fold import StreamingMean
from fedge.aggregator.rounds.replies import arrays_of, fold_reply, to_array_record
from fedge.models.anomaly.statistics import (
    COUNT_KEY,
    add_statistics,
    fit,
    station_statistics,
    statistics_from_moments,
    statistics_to_moments,
    zero_moments,
)

GRID = (2, 2)
DIMS = 3


def _features(n: int, seed: int) -> np.ndarray:
    rng = np.random.default_rng(seed)
    return rng.normal(loc=seed, scale=1 + seed, size=(n, GRID[0] * GRID[1], DIMS))


def _reply(node: int, n: int, seed: int) -> Message:
    moments = statistics_to_moments(station_statistics(_features(n, seed), GRID))
    content = RecordDict(
        {
            "arrays": ArrayRecord(array_dict={k: Array(v) for k, v in moments.items()}),
            "metrics": MetricRecord({"num-examples": n}),
        }
    )
    return _message(node, content)


def _message(node: int, content: RecordDict) -> Message:
    metadata = Metadata(1, f"m-{node}", node, 0, "", "", 0.0, 60.0, "train")
    return make_message(metadata, content)


def test_the_fold_of_moments_is_the_pooled_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    # Messages are made inside a ServerApp, which knows its run: as the sim tests do.
    monkeypatch.setattr(TaskIdentity, "_task_id", 1)
    monkeypatch.setattr(TaskIdentity, "_run_id", 1)
    monkeypatch.setattr(TaskIdentity, "_node_id", 0)
    backbone = ArrayRecord(array_dict={"w": Array(np.ones(2, np.float32))})
    strategy = StatisticsFedAvg(per_round=3, seed=0, backbone=backbone)
    sent = to_array_record(zero_moments(GRID, DIMS))
    plan = RoundPlan(selected=(1, 2, 3), quorum=3, deadline_s=None)
    messages = strategy._messages(1, sent, ConfigRecord({}), plan)
    assert all(m.content.array_records[BACKBONE_KEY] is backbone for m in messages)

    fold = StreamingMean()
    sizes = {1: 5, 2: 2, 3: 40}  # a 2-part station too: its covariance alone is singular
    for node, n in sizes.items():
        fold_reply(fold, _reply(node, n, seed=node), "arrays", (sent,), ())
    result = arrays_of(strategy.aggregate(1, sent, {"": fold}, {}))
    assert result[COUNT_KEY].tolist() == [47.0]

    model = fleet_fit(result)
    pooled_stats = add_statistics(
        [station_statistics(_features(n, seed=node), GRID) for node, n in sizes.items()]
    )
    pooled = fit(pooled_stats)
    assert model.count == 47
    np.testing.assert_allclose(model.mean, pooled.mean, rtol=0, atol=1e-12)
    np.testing.assert_allclose(model.covariance, pooled.covariance, rtol=0, atol=1e-10)
    rebuilt = statistics_from_moments(result, 47)
    np.testing.assert_allclose(rebuilt.outer, pooled_stats.outer, rtol=1e-13, atol=0)
    assert np.all(np.linalg.eigvalsh(model.covariance) > 0)


def test_the_fold_of_noisy_releases_is_their_sum_and_fits_to_an_invertible_model() -> None:
    # Under DP each station sends its noisy release's moments with its noisy count: the
    # fold is then exactly the sum of the releases, whose fit clips noise's negative
    # eigenvalues (a 2-part station's release is mostly noise).
    from fedge.models.anomaly.private import clip_features, noisy_statistics

    rng = np.random.default_rng(3)
    releases = [
        noisy_statistics(
            station_statistics(clip_features(_features(n, seed=n), 1.0), GRID),
            clip=1.0,
            noise_multiplier=1.0,
            rng=rng,
        )
        for n in (2, 9, 30)
    ]
    sent = to_array_record(zero_moments(GRID, DIMS))
    strategy = StatisticsFedAvg(per_round=3, seed=0, backbone=ArrayRecord())
    fold = StreamingMean()
    for node, release in enumerate(releases, start=1):
        moments = statistics_to_moments(release)
        content = RecordDict(
            {
                "arrays": ArrayRecord(array_dict={k: Array(v) for k, v in moments.items()}),
                "metrics": MetricRecord({"num-examples": release.count}),
            }
        )
        fold_reply(fold, _message(node, content), "arrays", (sent,), ())
    model = fleet_fit(arrays_of(strategy.aggregate(1, sent, {"": fold}, {})))
    summed = add_statistics(releases)
    assert model.count == summed.count
    np.testing.assert_allclose(model.mean, fit(summed).mean, rtol=0, atol=1e-12)
    np.testing.assert_allclose(model.covariance, fit(summed).covariance, rtol=0, atol=1e-10)
    assert np.all(np.linalg.eigvalsh(model.covariance) > 0)


def test_a_reply_of_other_shapes_is_refused_before_anything_is_folded() -> None:
    sent = to_array_record(zero_moments(GRID, DIMS))
    other = _message(
        1,
        RecordDict(
            {
                "arrays": to_array_record(zero_moments((1, 1), DIMS)),
                "metrics": MetricRecord({"num-examples": 4}),
            }
        ),
    )
    fold = StreamingMean()
    with pytest.raises(ValueError, match="not the model that was sent"):
        fold_reply(fold, other, "arrays", (sent,), ())
    assert fold.count == 0


def test_nothing_added_is_nothing_to_fit() -> None:
    with pytest.raises(JobError, match="no station's statistics"):
        fleet_fit(zero_moments(GRID, DIMS))


JOB = """
[job]
name = "normal-parts"
rounds = {rounds}

[task]
model = "inspect:3"
family = "anomaly"
{extra}
[federation]
backend = "fleet"
fleet = "plant-a"
edges = ["st-01", "st-02"]
"""


def test_an_anomaly_manifest_is_one_round_of_sums() -> None:
    manifest = parse_fleet_manifest(
        JOB.format(rounds=1, extra="[anomaly]\nstages = 2\nfalse_alarm_rate = 0.02\n")
    )
    assert manifest.is_anomaly and manifest.kind == "fedavg"
    assert manifest.publish_name == "inspect-anomaly"
    assert manifest.anomaly is not None
    assert manifest.anomaly.to_config()["anomaly-stages"] == 2
    assert manifest.anomaly.to_config()["anomaly-false-alarm-rate"] == 0.02


@pytest.mark.parametrize(
    ("rounds", "extra", "message"),
    [
        (3, "", "job.rounds must be 1 for an anomaly job"),
        (1, '[strategy]\nkind = "tiered"\n', 'strategy.kind must be "fedavg"'),
        (1, '[strategy]\nkind = "fedavg"\n[strategy.params]\nmu = 0.1\n', "no strategy param"),
        (
            1,
            '[anomaly]\nclip = 1.0\n[privacy]\nmode = "central"\nnoise_multiplier = 1.0\n',
            'mode = "central" would show the server',
        ),
        (1, "[privacy]\nsecagg = true\n", "anomaly.clip must be > 0 under"),
        (1, '[privacy]\nmode = "local"\nnoise_multiplier = 1.0\n', "anomaly.clip must be > 0"),
        (
            1,
            '[anomaly]\nclip = 1.0\n[privacy]\nmode = "local"\nnoise_multiplier = 1.0\n'
            "secagg = true\n",
            "together are not supported",
        ),
        (
            1,
            '[anomaly]\nclip = 1.0\n[privacy]\nmode = "local"\nnoise_multiplier = 1.0\n'
            "clipping_norm = 2.0\n",
            "clipped by \\[anomaly\\] clip",
        ),
        (
            1,
            "[anomaly]\nclip = 1.0\n[privacy]\nsecagg = true\nsecagg_clipping_range = 9.0\n",
            "chosen from \\[anomaly\\] clip",
        ),
        (1, '[anomaly]\nclip = 1.0\n[privacy]\nmode = "local"\n', "needs a target"),
        (1, "[anomaly]\nstages = 4\n", "anomaly.stages must be 1, 2 or 3"),
        (1, "[anomaly]\nfalse_alarm_rate = 1.5\n", "anomaly.false_alarm_rate"),
        (1, "[anomaly]\nwindow = 3\n", "window"),
    ],
)
def test_bad_anomaly_manifests_name_the_field(rounds: int, extra: str, message: str) -> None:
    with pytest.raises(ManifestError, match=message):
        parse_fleet_manifest(JOB.format(rounds=rounds, extra=extra))


def test_an_anomaly_manifest_takes_secagg_or_the_stations_dp() -> None:
    three = JOB.replace('["st-01", "st-02"]', '["st-01", "st-02", "st-03"]')
    secure = parse_fleet_manifest(
        three.format(rounds=1, extra="[anomaly]\nclip = 2.0\n[privacy]\nsecagg = true\n")
    ).anomaly
    assert secure is not None and secure.privacy.secagg and secure.clip == 2.0
    private = parse_fleet_manifest(
        JOB.format(
            rounds=1,
            extra='[anomaly]\nclip = 2.0\n[privacy]\nmode = "local"\nepsilon = 4.0\ndelta = 1e-5\n',
        )
    ).anomaly
    assert private is not None and private.privacy.mode.value == "local"
    assert (private.privacy.epsilon, private.privacy.delta) == (4.0, 1e-5)
    plain = parse_fleet_manifest(JOB.format(rounds=1, extra="")).anomaly
    assert plain is not None and not plain.privacy.enabled


def test_anomaly_settings_belong_to_anomaly_jobs() -> None:
    text = JOB.format(rounds=1, extra='[strategy]\nkind = "fedavg"\n[anomaly]\nstages = 1\n')
    with pytest.raises(ManifestError, match=r"\[anomaly\] is for anomaly jobs"):
        parse_fleet_manifest(text.replace('family = "anomaly"\n', ""))
    with pytest.raises(ManifestError, match=r"task\.family must be one of"):
        parse_fleet_manifest(text.replace('"anomaly"\n', '"gan"\n', 1))

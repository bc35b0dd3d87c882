"""The strict JSON wire codec: golden bytes, round trips, and everything it must refuse."""

import dataclasses
import json
import math
import random
from typing import Any

import pytest
from conftest import PNG_2X2

from fedge.protocols import codec
from fedge.protocols.alerts import Alert, AlertKind, AlertState
from fedge.protocols.config import (
    ConfigReport,
    ConfigStatus,
    EdgeConfig,
    PrivacyBudget,
    TrainingPolicy,
)
from fedge.protocols.deployment import DeploymentDesired, DeployStage, DeployStatus
from fedge.protocols.enrollment import EnrollRequest, EnrollResponse, RenewRequest
from fedge.protocols.errors import DecodeError, OversizedError, ProtocolError, ValidationError
from fedge.protocols.evaluation import (
    EvaluationItem,
    EvaluationReport,
    EvaluationRequest,
    EvaluationStatus,
)
from fedge.protocols.labels import StationLabels
from fedge.protocols.liveness import EdgeState, Liveness
from fedge.protocols.manifest import Lineage, ModelManifest, Preprocess, TensorSpec, Trainable
from fedge.protocols.pace import TelemetryPace
from fedge.protocols.records import (
    AnomalyScore,
    LabelRecord,
    MetricRecord,
    PredictionRecord,
    RecordBatch,
    Stream,
)
from fedge.protocols.thumbnails import ThumbnailPolicy, ThumbnailRecord
from fedge.protocols.trust import KeyRotation, TrustChain, TrustReport, TrustStatus

T0 = 1700000000.5  # exactly representable, so its JSON text is stable
U64_MAX = 2**64 - 1

# ---------------------------------------------------------------- the golden messages

EDGE_CONFIG = EdgeConfig(
    fleet="plant-a",
    edge="edge-01",
    version=3,
    default_threshold=0.5,
    class_thresholds={"scratch": 0.25, "dent": 0.75},
    report_interval_s=2.5,
    batch_max_records=100,
    issued_at=T0,
)
CONFIG_REPORT = ConfigReport(
    edge="edge-01",
    status=ConfigStatus.REJECTED,
    applied_version=2,
    offered_version=3,
    reason="seuil refusé",
    reported_at=T0,
)
MODEL_MANIFEST = ModelManifest(
    name="inspect",
    version=2,
    sha256="ab" * 32,
    size=123456,
    inputs=(TensorSpec("image", "float32", ("batch", 3, 224, 224)),),
    outputs=(TensorSpec("scores", "float32", ("batch", 2)),),
    classes=("ok", "defect"),
    positive_classes=("defect",),
    created_at=T0,
    lineage=Lineage(parent_version=1, run_id="run-7", data=None, note="fedavg round 5"),
)
DEPLOYMENT = DeploymentDesired(
    fleet="plant-a",
    edge="edge-01",
    version=4,
    deployment_id="dep-42",
    manifest_envelope='{"kind":"signed"}',
    grpc_target="manager:50051",
    issued_at=T0,
)
DEPLOY_STATUS = DeployStatus(
    edge="edge-01",
    deployment_id="dep-42",
    version=4,
    model_name="inspect",
    model_version=2,
    stage=DeployStage.ACTIVE,
    serving="inspect:2",
    reported_at=T0,
)
LIVENESS = Liveness(
    edge="edge-01",
    session=7,
    state=EdgeState.LOST,
    agent_version="0.1.0",
    serving="inspect:2",
    applied_config_version=3,
    at=T0,
)
TELEMETRY = RecordBatch(
    edge="edge-01",
    stream=Stream.TELEMETRY,
    session=7,
    seq=41,
    records=(MetricRecord("cpu_temp_c", 61.5, T0), MetricRecord("latency_p95_ms", 12.25, T0)),
)
PREDICTIONS = RecordBatch(
    edge="edge-01",
    stream=Stream.PREDICTIONS,
    session=7,
    seq=42,
    records=(
        PredictionRecord(
            prediction_id="p-0001",
            at=T0,
            model="inspect:2",
            scores={"ok": 0.125, "defect": 0.875},
            decision="reject",
            threshold=0.5,
            config_version=3,
            latency_ms=8.5,
            source="cam-1/frame-17.png",
        ),
    ),
)
# Issue 28: an anomaly model served beside the classifier (optional, omitted while unset).
ANOMALY_PREDICTIONS = RecordBatch(
    edge="edge-01",
    stream=Stream.PREDICTIONS,
    session=7,
    seq=43,
    records=(
        PredictionRecord(
            prediction_id="p-0002",
            at=T0,
            model="inspect:2",
            scores={"ok": 0.875, "defect": 0.125},
            decision="accept",
            threshold=0.5,
            config_version=3,
            latency_ms=8.5,
            anomaly=AnomalyScore("inspect-anomaly:1", 14.5, 12.25),
        ),
    ),
)
ANOMALY_DEPLOYMENT = DeploymentDesired(
    fleet="plant-a",
    edge="edge-01",
    version=5,
    deployment_id="dep-43",
    manifest_envelope='{"kind":"signed"}',
    grpc_target="manager:50051",
    issued_at=T0,
    anomaly_envelope='{"kind":"signed","n":2}',
)
LABELS = RecordBatch(
    edge="edge-01",
    stream=Stream.LABELS,
    session=7,
    seq=U64_MAX,  # the full 64-bit range must survive as an exact JSON integer
    records=(LabelRecord("l-0001", "p-0001", "defect", "operator-7", T0),),
)

STATION_LABELS = StationLabels(
    fleet="plant-a",
    edge="edge-01",
    version=2,
    labels=(LabelRecord("l-0002", "p-0001", "ok", "operator-7", T0),),
    issued_at=T0,
)
EVALUATION_REQUEST = EvaluationRequest(
    fleet="plant-a",
    edge="edge-01",
    version=5,
    eval_id="ev-7",
    manifest_envelopes=('{"kind":"signed"}',),
    grpc_target="manager:50051",
    max_images=50,
    issued_at=T0,
)
EVALUATION_REPORT = EvaluationReport(
    edge="edge-01",
    eval_id="ev-7",
    version=5,
    status=EvaluationStatus.DONE,
    holdout=12,
    items=(
        EvaluationItem(
            "p-0001", "inspect:2", "defect", {"ok": 0.125, "defect": 0.875}, {"mean": 0.5}
        ),
    ),
    reported_at=T0,
)
# Optional extensions: present on the wire only when set (older agents decode the rest).
TRAINING_CONFIG = EdgeConfig(
    fleet="plant-a",
    edge="edge-01",
    version=4,
    issued_at=T0,
    training=TrainingPolicy(enabled=True, max_minutes=7.5, threads=2),
)
PRIVACY_CONFIG = EdgeConfig(
    fleet="plant-a",
    edge="edge-01",
    version=5,
    issued_at=T0,
    privacy=PrivacyBudget(epsilon=8.0, delta=0.001),
)
TRAINABLE_MANIFEST = ModelManifest(
    name="inspect",
    version=3,
    sha256="ab" * 32,
    size=9,
    inputs=(TensorSpec("image", "float32", ("batch", 1, 32, 32)),),
    outputs=(TensorSpec("probs", "float32", ("batch", 2)),),
    classes=("ok", "defect"),
    created_at=T0,
    preprocess=Preprocess(image_size=32),
    trainable=Trainable("inspection-cnn", {"width": 16}, "cd" * 32, 77),
)

# Reviewed by hand: one flat object, compact separators, keys sorted at every level,
# "schema": 1 and "kind" beside the fields, enums as their values, tuples as arrays in
# their own order (classes are NOT sorted), None as null, non-ASCII escaped as \uXXXX,
# and integers never widened to floats.
ALERT = Alert(
    alert_id="a-1",
    fleet="plant-a",
    edge="edge-01",
    model="inspect:1",
    condition=AlertKind.INPUT_DRIFT,
    state=AlertState.RAISED,
    value=1.5,
    threshold=0.25,
    detail='{"drifted":["mean"]}',
    raised_at=1700000000.0,
)
GOLDEN: list[tuple[Any, bytes]] = [
    (
        EDGE_CONFIG,
        b'{"batch_max_records":100,"class_thresholds":{"dent":0.75,"scratch":0.25},'
        b'"default_threshold":0.5,"edge":"edge-01","fleet":"plant-a","issued_at":1700000000.5,'
        b'"kind":"edge_config","report_interval_s":2.5,"schema":1,"version":3}',
    ),
    (
        CONFIG_REPORT,
        b'{"applied_version":2,"edge":"edge-01","kind":"config_report","offered_version":3,'
        b'"reason":"seuil refus\\u00e9","reported_at":1700000000.5,"schema":1,'
        b'"status":"rejected"}',
    ),
    (
        MODEL_MANIFEST,
        b'{"classes":["ok","defect"],"created_at":1700000000.5,'
        b'"inputs":[{"dtype":"float32","name":"image","shape":["batch",3,224,224]}],'
        b'"kind":"model_manifest",'
        b'"lineage":{"data":null,"note":"fedavg round 5","parent_version":1,"run_id":"run-7"},'
        b'"name":"inspect",'
        b'"outputs":[{"dtype":"float32","name":"scores","shape":["batch",2]}],'
        b'"positive_classes":["defect"],"schema":1,'
        b'"sha256":"abababababababababababababababababababababababababababababababab",'
        b'"size":123456,"version":2}',
    ),
    (
        DEPLOYMENT,
        b'{"deployment_id":"dep-42","edge":"edge-01","fleet":"plant-a",'
        b'"grpc_target":"manager:50051","issued_at":1700000000.5,"kind":"deployment",'
        b'"manifest_envelope":"{\\"kind\\":\\"signed\\"}","schema":1,"version":4}',
    ),
    (
        DEPLOY_STATUS,
        b'{"deployment_id":"dep-42","edge":"edge-01","kind":"deploy_status",'
        b'"model_name":"inspect","model_version":2,"reason":"","reported_at":1700000000.5,'
        b'"schema":1,"serving":"inspect:2","stage":"active","version":4}',
    ),
    (
        LIVENESS,
        b'{"agent_version":"0.1.0","applied_config_version":3,"at":1700000000.5,'
        b'"edge":"edge-01","kind":"liveness","schema":1,"serving":"inspect:2","session":7,'
        b'"state":"lost"}',
    ),
    (
        TELEMETRY,
        b'{"edge":"edge-01","kind":"record_batch","records":['
        b'{"at":1700000000.5,"name":"cpu_temp_c","value":61.5},'
        b'{"at":1700000000.5,"name":"latency_p95_ms","value":12.25}],'
        b'"schema":1,"seq":41,"session":7,"stream":"telemetry"}',
    ),
    (
        PREDICTIONS,
        b'{"edge":"edge-01","kind":"record_batch","records":['
        b'{"at":1700000000.5,"config_version":3,"decision":"reject","latency_ms":8.5,'
        b'"model":"inspect:2","prediction_id":"p-0001","scores":{"defect":0.875,"ok":0.125},'
        b'"source":"cam-1/frame-17.png","threshold":0.5}],'
        b'"schema":1,"seq":42,"session":7,"stream":"predictions"}',
    ),
    (
        LABELS,
        b'{"edge":"edge-01","kind":"record_batch","records":['
        b'{"at":1700000000.5,"label":"defect","label_id":"l-0001","prediction_id":"p-0001",'
        b'"who":"operator-7"}],'
        b'"schema":1,"seq":18446744073709551615,"session":7,"stream":"labels"}',
    ),
    (
        STATION_LABELS,
        b'{"edge":"edge-01","fleet":"plant-a","issued_at":1700000000.5,'
        b'"kind":"station_labels","labels":[{"at":1700000000.5,"label":"ok",'
        b'"label_id":"l-0002","prediction_id":"p-0001","who":"operator-7"}],'
        b'"schema":1,"version":2}',
    ),
    (
        TRAINING_CONFIG,
        b'{"batch_max_records":500,"class_thresholds":{},"default_threshold":0.5,'
        b'"edge":"edge-01","fleet":"plant-a","issued_at":1700000000.5,"kind":"edge_config",'
        b'"report_interval_s":5.0,"schema":1,'
        b'"training":{"enabled":true,"max_minutes":7.5,"threads":2},"version":4}',
    ),
    (
        PRIVACY_CONFIG,
        b'{"batch_max_records":500,"class_thresholds":{},"default_threshold":0.5,'
        b'"edge":"edge-01","fleet":"plant-a","issued_at":1700000000.5,"kind":"edge_config",'
        b'"privacy":{"delta":0.001,"epsilon":8.0},"report_interval_s":5.0,"schema":1,'
        b'"version":5}',
    ),
    (
        TRAINABLE_MANIFEST,
        b'{"classes":["ok","defect"],"created_at":1700000000.5,'
        b'"inputs":[{"dtype":"float32","name":"image","shape":["batch",1,32,32]}],'
        b'"kind":"model_manifest",'
        b'"lineage":{"data":null,"note":"","parent_version":null,"run_id":null},'
        b'"name":"inspect",'
        b'"outputs":[{"dtype":"float32","name":"probs","shape":["batch",2]}],'
        b'"positive_classes":[],"preprocess":{"channels":1,"image_size":32,'
        b'"resample":"bilinear","scale":0.00392156862745098},"schema":1,'
        b'"sha256":"abababababababababababababababababababababababababababababababab",'
        b'"size":9,"trainable":{"family":"inspection-cnn","params":{"width":16},'
        b'"weights_sha256":"cdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcdcd",'
        b'"weights_size":77},"version":3}',
    ),
    (
        EVALUATION_REQUEST,
        b'{"edge":"edge-01","eval_id":"ev-7","fleet":"plant-a","grpc_target":"manager:50051",'
        b'"issued_at":1700000000.5,"kind":"evaluation_request",'
        b'"manifest_envelopes":["{\\"kind\\":\\"signed\\"}"],"max_images":50,"schema":1,'
        b'"version":5}',
    ),
    (
        EVALUATION_REPORT,
        b'{"edge":"edge-01","eval_id":"ev-7","holdout":12,"items":[{"label":"defect",'
        b'"model":"inspect:2","prediction_id":"p-0001","scores":{"defect":0.875,"ok":0.125},'
        b'"stats":{"mean":0.5}}],"kind":"evaluation_report","reason":"",'
        b'"reported_at":1700000000.5,"schema":1,"status":"done","version":5}',
    ),
    (
        ALERT,
        b'{"alert_id":"a-1","cleared_at":null,"cleared_by":"","condition":"input_drift",'
        b'"detail":"{\\"drifted\\":[\\"mean\\"]}","edge":"edge-01","fleet":"plant-a",'
        b'"kind":"alert","model":"inspect:1","raised_at":1700000000.0,"schema":1,'
        b'"state":"raised","threshold":0.25,"value":1.5}',
    ),
    (
        EnrollRequest("edge-01", "A" * 24, "-----BEGIN CERTIFICATE REQUEST-----"),
        b'{"csr":"-----BEGIN CERTIFICATE REQUEST-----","edge":"edge-01",'
        b'"kind":"enroll_request","schema":1,"token":"AAAAAAAAAAAAAAAAAAAAAAAA"}',
    ),
    (
        EnrollResponse(
            "plant-a",
            "edge-01",
            "CERT",
            "CA",
            "KEY",
            "manager",
            8883,
            "manager:50051",
            "manager:9092",
        ),
        b'{"broker_host":"manager","broker_port":8883,"ca":"CA","certificate":"CERT",'
        b'"edge":"edge-01","fleet":"plant-a","grpc_target":"manager:50051",'
        b'"kind":"enroll_response","manager_public_key":"KEY","schema":1,'
        b'"superlink":"manager:9092"}',
    ),
    (RenewRequest("CSR"), b'{"csr":"CSR","kind":"renew_request","schema":1}'),
    (
        KeyRotation("plant-a", 1, "OLD", "KEY", 1700000000.0),
        b'{"fleet":"plant-a","issued_at":1700000000.0,"kind":"key_rotation",'
        b'"new_key":"KEY","old_key":"OLD","schema":1,"sequence":1}',
    ),
    (
        TrustChain("plant-a", ("L1", "L2")),
        b'{"fleet":"plant-a","kind":"trust_chain","links":["L1","L2"],"schema":1}',
    ),
    (
        TrustChain("plant-a", ("L1",), 1700000000.0),
        b'{"expires_at":1700000000.0,"fleet":"plant-a","kind":"trust_chain","links":["L1"],'
        b'"schema":1}',
    ),
    (
        TrustReport("edge-01", TrustStatus.ADOPTED, "0123456789abcdef", 2, "", 1700000000.0),
        b'{"at":1700000000.0,"edge":"edge-01","key_id":"0123456789abcdef","kind":"trust_report",'
        b'"reason":"","schema":1,"sequence":2,"status":"adopted"}',
    ),
    (
        RecordBatch("edge-01", Stream.THUMBNAILS, 7, 3, (ThumbnailRecord("p-0001", T0, PNG_2X2),)),
        b'{"edge":"edge-01","kind":"record_batch","records":[{"at":1700000000.5,"png":"'
        + PNG_2X2.encode()
        + b'","prediction_id":"p-0001"}],"schema":1,"seq":3,"session":7,"stream":"thumbnails"}',
    ),
    (
        EdgeConfig(
            "plant-a", "edge-01", 6, issued_at=T0, thumbnails=ThumbnailPolicy(48, False, 10)
        ),
        b'{"batch_max_records":500,"class_thresholds":{},"default_threshold":0.5,'
        b'"edge":"edge-01","fleet":"plant-a","issued_at":1700000000.5,"kind":"edge_config",'
        b'"report_interval_s":5.0,"schema":1,"thumbnails":{"per_minute":10,'
        b'"rejects_only":false,"size":48},"version":6}',
    ),
    (
        TelemetryPace("plant-a", "edge-01", 3, 6.0, "short of space", T0),
        b'{"edge":"edge-01","factor":6.0,"fleet":"plant-a","issued_at":1700000000.5,'
        b'"kind":"telemetry_pace","reason":"short of space","schema":1,"version":3}',
    ),
    (
        ANOMALY_PREDICTIONS,
        b'{"edge":"edge-01","kind":"record_batch","records":['
        b'{"anomaly":{"model":"inspect-anomaly:1","score":14.5,"threshold":12.25},'
        b'"at":1700000000.5,"config_version":3,"decision":"accept","latency_ms":8.5,'
        b'"model":"inspect:2","prediction_id":"p-0002","scores":{"defect":0.125,"ok":0.875},'
        b'"source":"","threshold":0.5}],'
        b'"schema":1,"seq":43,"session":7,"stream":"predictions"}',
    ),
    (
        ANOMALY_DEPLOYMENT,
        b'{"anomaly_envelope":"{\\"kind\\":\\"signed\\",\\"n\\":2}","deployment_id":"dep-43",'
        b'"edge":"edge-01","fleet":"plant-a","grpc_target":"manager:50051",'
        b'"issued_at":1700000000.5,"kind":"deployment",'
        b'"manifest_envelope":"{\\"kind\\":\\"signed\\"}","schema":1,"version":5}',
    ),
]
GOLDEN_IDS = [
    "edge_config",
    "config_report",
    "model_manifest",
    "deployment",
    "deploy_status",
    "liveness",
    "batch_telemetry",
    "batch_predictions",
    "batch_labels",
    "station_labels",
    "edge_config_training",
    "edge_config_privacy",
    "model_manifest_trainable",
    "evaluation_request",
    "evaluation_report",
    "alert",
    "enroll_request",
    "enroll_response",
    "renew_request",
    "key_rotation",
    "trust_chain",
    "trust_chain_expiring",
    "trust_report",
    "batch_thumbnails",
    "edge_config_thumbnails",
    "telemetry_pace",
    "batch_predictions_anomaly",
    "deployment_anomaly",
]


@pytest.mark.parametrize(("message", "golden"), GOLDEN, ids=GOLDEN_IDS)
def test_encode_matches_golden_bytes(message: Any, golden: bytes) -> None:
    assert codec.encode(message) == golden


@pytest.mark.parametrize(("message", "golden"), GOLDEN, ids=GOLDEN_IDS)
def test_decode_golden_bytes_round_trips(message: Any, golden: bytes) -> None:
    decoded = codec.decode(golden, type(message))
    assert decoded == message
    assert type(decoded) is type(message)
    assert codec.encode(decoded) == golden


def test_golden_covers_every_kind_and_stream() -> None:
    assert {type(m) for m, _ in GOLDEN} == set(codec.KINDS)
    assert {m.stream for m, _ in GOLDEN if isinstance(m, RecordBatch)} == set(Stream)


def test_a_manifest_whose_preprocessing_cannot_feed_its_input_is_invalid() -> None:
    with pytest.raises(ValidationError, match="axis 2 is 32, but preprocess makes 28"):
        dataclasses.replace(TRAINABLE_MANIFEST, preprocess=Preprocess(image_size=28))
    with pytest.raises(ValidationError, match="channels"):
        Preprocess(image_size=32, channels=2)


def test_decoded_values_have_wire_types() -> None:
    manifest = codec.decode(codec.encode(MODEL_MANIFEST), ModelManifest)
    assert type(manifest.inputs) is tuple
    assert type(manifest.inputs[0].shape) is tuple
    assert manifest.inputs[0].shape == ("batch", 3, 224, 224)
    assert type(manifest.classes) is tuple
    assert type(manifest.lineage) is Lineage
    assert manifest.lineage.data is None

    report = codec.decode(codec.encode(CONFIG_REPORT), ConfigReport)
    assert report.status is ConfigStatus.REJECTED
    assert report.reason == "seuil refusé"

    batch = codec.decode(codec.encode(PREDICTIONS), RecordBatch)
    assert batch.stream is Stream.PREDICTIONS
    assert type(batch.records) is tuple
    assert type(batch.records[0]) is PredictionRecord


def test_integer_json_number_is_accepted_for_a_float_field() -> None:
    payload = _payload("liveness", at=1700000000)
    decoded = codec.decode(payload, Liveness)
    assert decoded.at == 1700000000.0
    assert type(decoded.at) is float


def test_defaults_apply_when_optional_fields_are_absent() -> None:
    obj = {"schema": 1, "kind": "edge_config", "fleet": "f", "edge": "e", "version": 1}
    config = codec.decode(json.dumps(obj).encode(), EdgeConfig)
    assert config == EdgeConfig(fleet="f", edge="e", version=1)

    obj = {"schema": 1, "kind": "record_batch", "edge": "e", "stream": "labels"}
    obj |= {"session": 0, "seq": 0}
    batch = codec.decode(json.dumps(obj).encode(), RecordBatch)
    assert batch.records == ()


def test_a_config_from_before_privacy_budgets_still_decodes() -> None:
    """Bytes an older manager signed (no ``privacy``) decode as "no lifetime bound", and
    a config without a budget encodes without the field, so an older agent decodes it."""
    older = (
        b'{"batch_max_records":500,"class_thresholds":{},"default_threshold":0.5,'
        b'"edge":"edge-01","fleet":"plant-a","issued_at":1700000000.5,"kind":"edge_config",'
        b'"report_interval_s":5.0,"schema":1,'
        b'"training":{"enabled":true,"max_minutes":7.5,"threads":2},"version":4}'
    )
    config = codec.decode(older, EdgeConfig)
    assert config.privacy is None
    assert codec.encode(config) == older
    cleared = dataclasses.replace(PRIVACY_CONFIG, privacy=None)
    assert b"privacy" not in codec.encode(cleared)


def test_key_order_and_whitespace_on_the_wire_do_not_matter() -> None:
    obj = json.loads(codec.encode(TELEMETRY))
    reordered = dict(reversed(list(obj.items())))
    payload = json.dumps(reordered, indent=2).encode()
    assert codec.decode(payload, RecordBatch) == TELEMETRY


def test_u64_boundaries_are_accepted() -> None:
    payload = _payload("record_batch", session=0, seq=U64_MAX)
    batch = codec.decode(payload, RecordBatch)
    assert batch.seq == U64_MAX
    assert batch.session == 0


def test_encode_refuses_non_messages() -> None:
    with pytest.raises(TypeError, match="not a wire message"):
        codec.encode(MetricRecord("m", 1.0, 0.0))
    with pytest.raises(TypeError, match="not a wire message"):
        codec.encode({"schema": 1})


def test_kinds_are_distinct() -> None:
    assert len(set(codec.KINDS.values())) == len(codec.KINDS)


# ---------------------------------------------------------------- strictness

_BASES: dict[str, dict[str, Any]] = {
    "edge_config": json.loads(codec.encode(EDGE_CONFIG)),
    "config_report": json.loads(codec.encode(CONFIG_REPORT)),
    "model_manifest": json.loads(codec.encode(MODEL_MANIFEST)),
    "deployment": json.loads(codec.encode(DEPLOYMENT)),
    "deploy_status": json.loads(codec.encode(DEPLOY_STATUS)),
    "liveness": json.loads(codec.encode(LIVENESS)),
    "record_batch": json.loads(codec.encode(TELEMETRY)),
    "predictions": json.loads(codec.encode(PREDICTIONS)),
    "labels": json.loads(codec.encode(LABELS)),
}
_CLS: dict[str, type[Any]] = {
    "edge_config": EdgeConfig,
    "config_report": ConfigReport,
    "model_manifest": ModelManifest,
    "deployment": DeploymentDesired,
    "deploy_status": DeployStatus,
    "liveness": Liveness,
    "record_batch": RecordBatch,
    "predictions": RecordBatch,
    "labels": RecordBatch,
}
_DROP = object()


def _obj(base: str, **changes: Any) -> dict[str, Any]:
    obj = json.loads(json.dumps(_BASES[base]))  # deep copy
    assert isinstance(obj, dict)
    for key, value in changes.items():
        if value is _DROP:
            del obj[key]
        else:
            obj[key] = value
    return obj


def _payload(base: str, **changes: Any) -> bytes:
    return json.dumps(_obj(base, **changes)).encode()


def _with_record(base: str, index: int, **changes: Any) -> bytes:
    obj = _obj(base)
    record = obj["records"][index]
    for key, value in changes.items():
        if value is _DROP:
            del record[key]
        else:
            record[key] = value
    return json.dumps(obj).encode()


def _replace(base: str, old: str, new: str) -> bytes:
    """Edit the wire text directly, for what json.dumps would not write (NaN, huge ints)."""
    text = json.dumps(_BASES[base])
    assert text.count(old) == 1, (old, text)
    return text.replace(old, new).encode()


# (id, class to decode as, payload, exact error class, substrings the message must contain)
_Case = tuple[str, type[Any], bytes, type[ProtocolError], tuple[str, ...]]
_CASES: list[_Case] = [
    # -- not JSON / not an object
    ("invalid_json", Liveness, b'{"schema":1,', DecodeError, ("JSON",)),
    ("empty_payload", Liveness, b"", DecodeError, ("JSON",)),
    ("trailing_garbage", Liveness, codec.encode(LIVENESS) + b"x", DecodeError, ("JSON",)),
    ("invalid_utf8", Liveness, b'{"edge":"\xff\xfe"}', DecodeError, ("JSON",)),
    ("top_level_array", Liveness, b"[]", DecodeError, ("message", "object", "array")),
    ("top_level_string", Liveness, b'"liveness"', DecodeError, ("message", "object", "string")),
    ("top_level_number", Liveness, b"1", DecodeError, ("message", "object", "number")),
    ("top_level_null", Liveness, b"null", DecodeError, ("message", "object", "null")),
    # -- envelope fields
    ("schema_2", Liveness, _payload("liveness", schema=2), DecodeError, ("schema", "2")),
    ("schema_0", Liveness, _payload("liveness", schema=0), DecodeError, ("schema",)),
    ("schema_string", Liveness, _payload("liveness", schema="1"), DecodeError, ("schema",)),
    ("schema_missing", Liveness, _payload("liveness", schema=_DROP), DecodeError, ("schema",)),
    ("wrong_kind", EdgeConfig, codec.encode(LIVENESS), DecodeError, ("kind", "liveness")),
    ("kind_missing", Liveness, _payload("liveness", kind=_DROP), DecodeError, ("kind",)),
    ("kind_unknown", Liveness, _payload("liveness", kind="heartbeat"), DecodeError, ("kind",)),
    # -- unknown / missing fields
    ("unknown_field", Liveness, _payload("liveness", colour="red"), DecodeError, ("colour",)),
    (
        "unknown_field_in_record",
        RecordBatch,
        _with_record("record_batch", 0, unit="C"),
        DecodeError,
        ("records[0]", "unit"),
    ),
    (
        "unknown_field_in_lineage",
        ModelManifest,
        _payload("model_manifest", lineage={"parent_version": 1, "author": "x"}),
        DecodeError,
        ("lineage", "author"),
    ),
    (
        "unknown_field_in_tensor",
        ModelManifest,
        _payload("model_manifest", inputs=[{"name": "i", "dtype": "float32", "shape": [], "x": 1}]),
        DecodeError,
        ("inputs[0]", "x"),
    ),
    ("missing_seq", RecordBatch, _payload("record_batch", seq=_DROP), DecodeError, ("seq",)),
    ("missing_edge", Liveness, _payload("liveness", edge=_DROP), DecodeError, ("edge",)),
    (
        "missing_stream",
        RecordBatch,
        _payload("record_batch", stream=_DROP),
        DecodeError,
        ("stream",),
    ),
    (
        "missing_field_in_record",
        RecordBatch,
        _with_record("record_batch", 1, value=_DROP),
        DecodeError,
        ("records[1]", "value"),
    ),
    # -- wrong JSON types
    (
        "bool_for_int",
        RecordBatch,
        _payload("record_batch", session=True),
        DecodeError,
        ("session", "integer", "boolean"),
    ),
    (
        "float_for_int",
        RecordBatch,
        _payload("record_batch", seq=1.0),
        DecodeError,
        ("seq", "integer"),
    ),
    (
        "string_for_int",
        EdgeConfig,
        _payload("edge_config", version="3"),
        DecodeError,
        ("version", "integer", "string"),
    ),
    (
        "null_for_int",
        EdgeConfig,
        _payload("edge_config", version=None),
        DecodeError,
        ("version", "null"),
    ),
    (
        "string_for_float",
        EdgeConfig,
        _payload("edge_config", default_threshold="0.5"),
        DecodeError,
        ("default_threshold", "number", "string"),
    ),
    (
        "bool_for_float",
        Liveness,
        _payload("liveness", at=False),
        DecodeError,
        ("at", "number", "boolean"),
    ),
    ("null_for_float", Liveness, _payload("liveness", at=None), DecodeError, ("at", "null")),
    ("number_for_string", Liveness, _payload("liveness", edge=1), DecodeError, ("edge", "string")),
    (
        "object_for_string",
        Liveness,
        _payload("liveness", serving={}),
        DecodeError,
        ("serving", "object"),
    ),
    (
        "array_for_map",
        EdgeConfig,
        _payload("edge_config", class_thresholds=[]),
        DecodeError,
        ("class_thresholds", "object"),
    ),
    (
        "string_in_map",
        EdgeConfig,
        _payload("edge_config", class_thresholds={"dent": "0.5"}),
        DecodeError,
        ("class_thresholds.dent", "number"),
    ),
    (
        "string_for_array",
        ModelManifest,
        _payload("model_manifest", classes="ok"),
        DecodeError,
        ("classes", "array"),
    ),
    (
        "bool_in_shape",
        ModelManifest,
        _payload("model_manifest", inputs=[{"name": "i", "dtype": "float32", "shape": [True]}]),
        DecodeError,
        ("inputs[0].shape[0]",),
    ),
    (
        "float_in_shape",
        ModelManifest,
        _payload("model_manifest", inputs=[{"name": "i", "dtype": "float32", "shape": [1.5]}]),
        DecodeError,
        ("inputs[0].shape[0]",),
    ),
    (
        "string_for_lineage_int",
        ModelManifest,
        _payload("model_manifest", lineage={"parent_version": "1"}),
        DecodeError,
        ("lineage.parent_version",),
    ),
    (
        "null_for_lineage",
        ModelManifest,
        _payload("model_manifest", lineage=None),
        DecodeError,
        ("lineage", "object"),
    ),
    (
        "bool_for_score",
        RecordBatch,
        _with_record("predictions", 0, scores={"ok": True}),
        DecodeError,
        ("records[0].scores.ok",),
    ),
    ("string_for_enum", Liveness, _payload("liveness", state=1), DecodeError, ("state",)),
    # -- non-standard JSON numbers
    (
        "nan_literal",
        EdgeConfig,
        _replace("edge_config", '"default_threshold": 0.5', '"default_threshold": NaN'),
        DecodeError,
        ("NaN",),
    ),
    (
        "infinity_literal",
        EdgeConfig,
        _replace("edge_config", '"default_threshold": 0.5', '"default_threshold": Infinity'),
        DecodeError,
        ("Infinity",),
    ),
    (
        "minus_infinity_literal",
        Liveness,
        _replace("liveness", '"at": 1700000000.5', '"at": -Infinity'),
        DecodeError,
        ("-Infinity",),
    ),
    # -- value rules
    (
        "threshold_1_5",
        EdgeConfig,
        _payload("edge_config", default_threshold=1.5),
        ValidationError,
        ("default_threshold", "1.5"),
    ),
    (
        "threshold_negative",
        EdgeConfig,
        _payload("edge_config", default_threshold=-0.1),
        ValidationError,
        ("default_threshold",),
    ),
    (
        "threshold_overflows_to_inf",
        EdgeConfig,
        _replace("edge_config", '"default_threshold": 0.5', '"default_threshold": 1e400'),
        DecodeError,
        ("default_threshold",),
    ),
    (
        "class_threshold_1_5",
        EdgeConfig,
        _payload("edge_config", class_thresholds={"dent": 1.5}),
        ValidationError,
        ("class_thresholds", "dent"),
    ),
    (
        "class_threshold_bad_key",
        EdgeConfig,
        _payload("edge_config", class_thresholds={"a/b": 0.5}),
        ValidationError,
        ("class_thresholds key", "a/b"),
    ),
    (
        "prediction_threshold_1_5",
        RecordBatch,
        _with_record("predictions", 0, threshold=1.5),
        ValidationError,
        ("records[0]", "threshold"),
    ),
    (
        "score_1_5",
        RecordBatch,
        _with_record("predictions", 0, scores={"ok": 1.5}),
        ValidationError,
        ("records[0]", "scores"),
    ),
    (
        "negative_latency",
        RecordBatch,
        _with_record("predictions", 0, latency_ms=-1.0),
        ValidationError,
        ("records[0]", "latency_ms"),
    ),
    (
        "metric_overflows_to_inf",
        RecordBatch,
        _replace("record_batch", '"value": 61.5', '"value": 1e400'),
        DecodeError,
        ("records[0]", "value", "out of range"),
    ),
    ("negative_seq", RecordBatch, _payload("record_batch", seq=-1), ValidationError, ("seq", "-1")),
    (
        "seq_2_64",
        RecordBatch,
        _payload("record_batch", seq=2**64),
        ValidationError,
        ("seq", str(2**64)),
    ),
    ("seq_huge", RecordBatch, _payload("record_batch", seq=10**30), ValidationError, ("seq",)),
    ("negative_session", Liveness, _payload("liveness", session=-1), ValidationError, ("session",)),
    (
        "session_2_64",
        RecordBatch,
        _payload("record_batch", session=2**64),
        ValidationError,
        ("session",),
    ),
    ("version_zero", EdgeConfig, _payload("edge_config", version=0), ValidationError, ("version",)),
    (
        "privacy_epsilon_zero",
        EdgeConfig,
        _payload("edge_config", privacy={"epsilon": 0.0, "delta": 0.001}),
        ValidationError,
        ("privacy.epsilon", "> 0"),
    ),
    (
        "privacy_delta_one",
        EdgeConfig,
        _payload("edge_config", privacy={"epsilon": 8.0, "delta": 1.0}),
        ValidationError,
        ("privacy.delta", "(0, 1)"),
    ),
    (
        "privacy_without_epsilon",
        EdgeConfig,
        _payload("edge_config", privacy={"delta": 0.001}),
        DecodeError,
        ("privacy", "PrivacyBudget"),
    ),
    (
        "batch_max_records_zero",
        EdgeConfig,
        _payload("edge_config", batch_max_records=0),
        ValidationError,
        ("batch_max_records",),
    ),
    (
        "batch_max_records_huge",
        EdgeConfig,
        _payload("edge_config", batch_max_records=10_001),
        ValidationError,
        ("batch_max_records",),
    ),
    (
        "report_interval_tiny",
        EdgeConfig,
        _payload("edge_config", report_interval_s=0.01),
        ValidationError,
        ("report_interval_s",),
    ),
    (
        "issued_at_negative",
        EdgeConfig,
        _payload("edge_config", issued_at=-1.0),
        ValidationError,
        ("issued_at",),
    ),
    (
        "edge_with_slash",
        RecordBatch,
        _payload("record_batch", edge="a/b"),
        ValidationError,
        ("edge", "a/b"),
    ),
    (
        "edge_with_plus",
        RecordBatch,
        _payload("record_batch", edge="+"),
        ValidationError,
        ("edge", "+"),
    ),
    (
        "edge_with_hash",
        RecordBatch,
        _payload("record_batch", edge="edge#1"),
        ValidationError,
        ("edge", "edge#1"),
    ),
    ("edge_dollar", Liveness, _payload("liveness", edge="$SYS"), ValidationError, ("edge", "$SYS")),
    ("edge_empty", Liveness, _payload("liveness", edge=""), ValidationError, ("edge",)),
    (
        "edge_leading_dot",
        Liveness,
        _payload("liveness", edge=".hidden"),
        ValidationError,
        ("edge",),
    ),
    ("edge_too_long", Liveness, _payload("liveness", edge="e" * 65), ValidationError, ("edge",)),
    ("edge_space", Liveness, _payload("liveness", edge="edge 1"), ValidationError, ("edge",)),
    (
        "fleet_with_slash",
        EdgeConfig,
        _payload("edge_config", fleet="a/b"),
        ValidationError,
        ("fleet", "a/b"),
    ),
    (
        "deployment_id_wildcard",
        DeploymentDesired,
        _payload("deployment", deployment_id="#"),
        ValidationError,
        ("deployment_id",),
    ),
    (
        "reason_too_long",
        ConfigReport,
        _payload("config_report", reason="x" * 1025),
        ValidationError,
        ("reason", "1025"),
    ),
    (
        "agent_version_too_long",
        Liveness,
        _payload("liveness", agent_version="1" * 65),
        ValidationError,
        ("agent_version",),
    ),
    (
        "sha256_uppercase",
        ModelManifest,
        _payload("model_manifest", sha256="AB" * 32),
        ValidationError,
        ("sha256",),
    ),
    (
        "sha256_short",
        ModelManifest,
        _payload("model_manifest", sha256="ab"),
        ValidationError,
        ("sha256",),
    ),
    (
        "model_size_zero",
        ModelManifest,
        _payload("model_manifest", size=0),
        ValidationError,
        ("size",),
    ),
    (
        "no_inputs",
        ModelManifest,
        _payload("model_manifest", inputs=[]),
        ValidationError,
        ("input",),
    ),
    (
        "no_classes",
        ModelManifest,
        _payload("model_manifest", classes=[], positive_classes=[]),
        ValidationError,
        ("class",),
    ),
    (
        "positive_not_in_classes",
        ModelManifest,
        _payload("model_manifest", positive_classes=["scratch"]),
        ValidationError,
        ("positive classes", "scratch"),
    ),
    (
        "unknown_dtype",
        ModelManifest,
        _payload("model_manifest", inputs=[{"name": "i", "dtype": "complex64", "shape": []}]),
        ValidationError,
        ("inputs[0]", "dtype", "complex64"),
    ),
    (
        "rank_9",
        ModelManifest,
        _payload("model_manifest", inputs=[{"name": "i", "dtype": "float32", "shape": [1] * 9}]),
        ValidationError,
        ("inputs[0]", "rank"),
    ),
    # -- enums
    (
        "stream_foo",
        RecordBatch,
        _payload("record_batch", stream="foo"),
        DecodeError,
        ("stream", "foo"),
    ),
    (
        "stream_wrong_case",
        RecordBatch,
        _payload("record_batch", stream="Telemetry"),
        DecodeError,
        ("stream",),
    ),
    (
        "decision_maybe",
        RecordBatch,
        _with_record("predictions", 0, decision="maybe"),
        ValidationError,
        ("records[0]", "decision", "maybe"),
    ),
    (
        "state_zombie",
        Liveness,
        _payload("liveness", state="zombie"),
        DecodeError,
        ("state", "zombie"),
    ),
    (
        "status_unknown",
        ConfigReport,
        _payload("config_report", status="pending"),
        DecodeError,
        ("status", "pending"),
    ),
    (
        "stage_unknown",
        DeployStatus,
        _payload("deploy_status", stage="rolled_forward"),
        DecodeError,
        ("stage", "rolled_forward"),
    ),
    # -- records vs stream
    (
        "label_record_on_telemetry",
        RecordBatch,
        _payload("record_batch", records=_BASES["labels"]["records"]),
        DecodeError,
        ("records[0]",),
    ),
    (
        "metric_record_on_predictions",
        RecordBatch,
        _payload("predictions", records=_BASES["record_batch"]["records"]),
        DecodeError,
        ("records[0]",),
    ),
    (
        "prediction_record_on_labels",
        RecordBatch,
        _payload("labels", records=_BASES["predictions"]["records"]),
        DecodeError,
        ("records[0]",),
    ),
    (
        "records_not_array",
        RecordBatch,
        _payload("record_batch", records={}),
        DecodeError,
        ("records", "array"),
    ),
    (
        "record_not_object",
        RecordBatch,
        _payload("record_batch", records=[1]),
        DecodeError,
        ("records[0]", "object"),
    ),
    (
        "records_null",
        RecordBatch,
        _payload("record_batch", records=None),
        DecodeError,
        ("records", "null"),
    ),
    # -- resource limits
    (
        "class_thresholds_over_1024",
        EdgeConfig,
        _payload("edge_config", class_thresholds={f"c{i}": 0.5 for i in range(1025)}),
        DecodeError,
        ("class_thresholds", "1024"),
    ),
    ("deep_nesting", Liveness, b"[" * 100_000, DecodeError, ("JSON",)),
    ("deep_nesting_objects", Liveness, b'{"a":' * 50_000, DecodeError, ("JSON",)),
    (
        "deep_nesting_in_field",
        RecordBatch,
        _replace("record_batch", '"records": [', '"records": ' + "[" * 100_000),
        DecodeError,
        ("JSON",),
    ),
]


@pytest.mark.parametrize(
    ("cls", "payload", "error", "fragments"),
    [pytest.param(c[1], c[2], c[3], c[4], id=c[0]) for c in _CASES],
)
def test_decode_rejects(
    cls: type[Any], payload: bytes, error: type[ProtocolError], fragments: tuple[str, ...]
) -> None:
    with pytest.raises(ProtocolError) as excinfo:
        codec.decode(payload, cls)
    assert type(excinfo.value) is error, repr(excinfo.value)
    message = str(excinfo.value)
    for fragment in fragments:
        assert fragment in message, (fragment, message)


def test_case_ids_are_unique() -> None:
    ids = [c[0] for c in _CASES]
    assert len(ids) == len(set(ids))


def test_oversized_payload_is_refused_before_parsing() -> None:
    payload = codec.encode(TELEMETRY)
    assert codec.decode(payload, RecordBatch, max_bytes=len(payload)) == TELEMETRY
    with pytest.raises(OversizedError) as excinfo:
        codec.decode(payload, RecordBatch, max_bytes=len(payload) - 1)
    assert type(excinfo.value) is OversizedError
    assert str(len(payload)) in str(excinfo.value)
    assert str(len(payload) - 1) in str(excinfo.value)
    # Not parsed: garbage over the limit is "oversized", not "not valid JSON".
    with pytest.raises(OversizedError):
        codec.decode(b"\xff" * 100, RecordBatch, max_bytes=99)


def test_default_size_limit() -> None:
    at_limit = b" " * (codec.DEFAULT_MAX_BYTES - len(codec.encode(LIVENESS)))
    payload = codec.encode(LIVENESS) + at_limit
    assert len(payload) == codec.DEFAULT_MAX_BYTES
    assert codec.decode(payload, Liveness) == LIVENESS
    with pytest.raises(OversizedError, match="limit 262144"):
        codec.decode(payload + b" ", Liveness)


def test_oversized_is_a_decode_error() -> None:
    assert issubclass(OversizedError, DecodeError)
    assert OversizedError.reason == "oversized"
    assert DecodeError.reason == "malformed"
    assert ValidationError.reason == "invalid"


def test_batch_over_10000_records_is_invalid() -> None:
    record = {"name": "m", "value": 1.0, "at": 0.0}
    payload = _payload("record_batch", records=[record] * 10_001)
    with pytest.raises(ValidationError, match="10000"):
        codec.decode(payload, RecordBatch, max_bytes=len(payload))
    payload = _payload("record_batch", records=[record] * 10_000)
    batch = codec.decode(payload, RecordBatch, max_bytes=len(payload))
    assert len(batch.records) == 10_000


def test_loads_refuses_constants_and_sizes() -> None:
    assert codec.loads(b'{"a": [1, 2.5]}') == {"a": [1, 2.5]}
    with pytest.raises(DecodeError, match="NaN"):
        codec.loads(b"[NaN]")
    with pytest.raises(OversizedError):
        codec.loads(b"[1]", max_bytes=2)


def test_constructors_enforce_the_same_rules() -> None:
    with pytest.raises(ValidationError, match="seq"):
        RecordBatch(edge="e", stream=Stream.TELEMETRY, session=0, seq=-1)
    with pytest.raises(ValidationError, match="MetricRecord"):
        RecordBatch(
            edge="e",
            stream=Stream.LABELS,
            session=0,
            seq=0,
            records=(MetricRecord("m", 1.0, 0.0),),
        )
    with pytest.raises(ValidationError, match="finite"):
        MetricRecord("m", math.nan, 0.0)


# ---------------------------------------------------- regressions: bugs found in review, now fixed


def test_bug_huge_integer_in_float_field_escapes_as_overflow_error() -> None:
    payload = _replace("liveness", '"at": 1700000000.5', '"at": 1' + "0" * 400)
    with pytest.raises(ProtocolError):
        codec.decode(payload, Liveness)


def test_bug_overflowing_float_literal_is_accepted_as_infinity() -> None:
    payload = _replace("liveness", '"at": 1700000000.5', '"at": 1e400')
    with pytest.raises(ProtocolError):
        codec.decode(payload, Liveness)


def test_bug_identifier_with_trailing_newline_is_accepted() -> None:
    with pytest.raises(ValidationError, match="edge"):
        codec.decode(_payload("liveness", edge="edge-01\n"), Liveness)


@pytest.mark.parametrize("schema", [True, 1.0])
def test_bug_schema_true_or_float_is_accepted(schema: Any) -> None:
    with pytest.raises(DecodeError, match="schema"):
        codec.decode(_payload("liveness", schema=schema), Liveness)


# ---------------------------------------------------------------- property: random mutations


def test_random_byte_mutations_only_raise_protocol_errors() -> None:
    rng = random.Random(0)
    original = codec.encode(PREDICTIONS)
    interesting = b'0123456789{}[]",:.-+eE \\tnu'
    decoded_ok = 0
    rejected = 0
    for i in range(500):
        data = bytearray(original)
        for _ in range(rng.randint(1, 3)):
            pos = rng.randrange(len(data))
            op = rng.random()
            byte = rng.choice(interesting) if rng.random() < 0.7 else rng.randrange(256)
            if op < 0.6:
                data[pos] = byte
            elif op < 0.8:
                data.insert(pos, byte)
            elif len(data) > 1:
                del data[pos]
        payload = bytes(data)
        try:
            batch = codec.decode(payload, RecordBatch)
        except ProtocolError:
            rejected += 1
            continue
        except Exception as exc:  # pragma: no cover - this is the failure being tested for
            pytest.fail(f"mutation {i} {payload!r} raised {type(exc).__name__}: {exc}")
        assert type(batch) is RecordBatch
        # Whatever decodes must be a message the codec can write again, identically.
        assert codec.decode(codec.encode(batch), RecordBatch) == batch
        decoded_ok += 1
    assert decoded_ok + rejected == 500
    # Sanity: the mutations exercise both outcomes.
    assert decoded_ok > 0
    assert rejected > 0

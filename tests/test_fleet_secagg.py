"""SecAgg+ with real SuperNodes: stations train with DP-SGD and only their masked sum leaves.

Real processes: the fleet's SuperLink, one ``flower-supernode`` per station started by the
agent's own supervisor (:mod:`fedge.edge_agent.training.supervisor`) on the station's data
directory, each running the station's ClientApp behind ``secagg_mod``, and fedge's fleet
ServerApp submitted with ``flwr run``. The job asks for DP-SGD with SecAgg+
(``[privacy] mode = "local"``, ``secagg = true``, a threshold of three). st-04 is at its
lifetime privacy budget: it takes part in SecAgg+'s key stages, then refuses to train
(an error reply at the masked-vector stage, before any training), and the round is
unmasked with the other three -- a dropout mid-protocol above the threshold (SecAgg+
never unmasks fewer than three, issue 24: two would each learn the other's update).

What the server received is recorded inside the deployed ServerApp: the test writes a
small ServerApp module into the job's Flower app (``recording_server.py``), which runs
:func:`fedge.aggregator.fleet.server.run_fleet_job` unchanged on a grid that keeps every
reply pulled off the SuperLink. No reply holds a model array: each station's update
arrives only as SecAgg+'s masked vector, whose values fill the modulus (the pairwise
masks) far beyond the quantization range an unmasked update would stay in.

Each ClientApp message starts a process that imports torch, and a SecAgg+ round is four
messages per station: four stations (three training, the fewest SecAgg+ unmasks) and one
round are what a test can afford on two cores (the job took 80-95 s here with three
stations; stages are paced by the SuperNode's 3 s idle poll and a ClientApp process start
each). A SuperNode SIGKILLed mid-round would cost a stage
timeout on top: Flower's SuperLink reports a dead node only once its heartbeat expires
(30 s interval, patience 2), and the workflow waits for it until then; so the dropout
here is the refusal, an error reply in the middle of the protocol.
"""

from __future__ import annotations

import io
import json
import time
from pathlib import Path
from typing import Any

import numpy as np
import pytest
from conftest import FleetHome, keep_labelled_images, make_fleet_home, publish_trainable, wait_until

from fedge.aggregator.jobs.checkpoint import load_arrays
from fedge.aggregator.jobs.run_store import RunStore
from fedge.aggregator.jobs.spec import ManifestError
from fedge.aggregator.superlink.link import SuperLink
from fedge.edge_agent.config.privacy_budget import apply_budget
from fedge.edge_agent.training.supervisor import SupernodeSpec, SupernodeSupervisor
from fedge.federation import fleet_job
from fedge.federation.prepare import APP_DIR, prepare
from fedge.party.budget import BudgetLedger
from fedge.party.families import weights_from_bytes
from fedge.party.privacy_status import LEDGER_FILE
from fedge.privacy import accounting
from fedge.privacy.settings import DpRelease, is_budget_exhausted
from fedge.protocols.app_signing import trusted_entities_yaml
from fedge.protocols.config import PrivacyBudget, TrainingPolicy

pytestmark = pytest.mark.integration

EDGES = ("st-01", "st-02", "st-03", "st-04")
REFUSING = "st-04"  # at its lifetime privacy budget: refuses at SecAgg+'s training stage
TRAINING = ("st-01", "st-02", "st-03")
EARLIER = DpRelease(noise_multiplier=1.0, sample_rate=0.25, steps=8)
QUANTIZATION_RANGE = 4_194_304  # PrivacySpec's default secagg_quantization_range
JOB = """
[job]
name = "secagg-fleet"
rounds = 1

[task]
model = "inspect:1"
lr = 0.003
local_epochs = 1
batch_size = 8

[strategy]
kind = "fedavg"
[strategy.params]
quorum_fraction = 0.5

[privacy]
mode = "local"
epsilon = 8.0
delta = 0.001
secagg = true
secagg_threshold = 3

[federation]
backend = "fleet"
fleet = "plant-a"
edges = "all"
node_wait_s = 60.0
round_timeout_s = 120.0
eval_timeout_s = 120.0
"""

RECORDING_SERVER = '''
"""The fleet ServerApp, on a grid that keeps every reply it pulls (test_fleet_secagg)."""

import json
import time
from pathlib import Path

import numpy as np
from flwr.app import Context
from flwr.serverapp import Grid, ServerApp

from fedge.aggregator.fleet.server import JOB_DIR_KEY, run_fleet_job
from fedge.aggregator.fleet.grids import WrappedGrid


class RecordingGrid(WrappedGrid):
    def __init__(self, inner, into):
        super().__init__(inner)
        self.into = into

    def get_node_ids(self):
        return self.inner.get_node_ids()

    def push_messages(self, messages):
        return self.inner.push_messages(messages)

    def pull_messages(self, message_ids):
        replies = list(self.inner.pull_messages(message_ids))
        self.into.extend((time.time(), r) for r in replies)
        return replies

    def send_and_receive(self, messages, *, timeout=None):
        replies = list(self.inner.send_and_receive(messages, timeout=timeout))
        self.into.extend((time.time(), r) for r in replies)
        return replies


def save(replies, job_dir):
    summary, blobs = [], {}
    for index, (at, reply) in enumerate(replies):
        entry = {
            "at": at,
            "type": reply.metadata.message_type,
            "error": str(reply.error.reason) if reply.has_error() else None,
            "arrays": {},
            "numpy": [],
        }
        summary.append(entry)
        if reply.has_error():  # an error reply has no content
            continue
        entry["arrays"] = {k: len(v) for k, v in reply.content.array_records.items()}
        for name, config in reply.content.config_records.items():
            for key, value in config.items():
                for j, blob in enumerate(value if isinstance(value, list) else [value]):
                    if isinstance(blob, bytes) and blob.startswith(b"\\x93NUMPY"):
                        blobs[f"{index}-{name}-{key}-{j}"] = blob
                        entry["numpy"].append(f"{index}-{name}-{key}-{j}")
    np.savez(job_dir / "received.npz", **{k: np.frombuffer(v, np.uint8) for k, v in blobs.items()})
    # The summary last, whole: the test waits for it (the run ends before this is written).
    (job_dir / "received.json.tmp").write_text(json.dumps(summary), encoding="utf-8")
    (job_dir / "received.json.tmp").replace(job_dir / "received.json")


app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    job_dir = Path(str(context.run_config[JOB_DIR_KEY]))
    replies = []
    try:
        run_fleet_job(RecordingGrid(grid, replies), job_dir)
    finally:
        save(replies, job_dir)
'''


def record_what_the_server_receives(job_dir: Path) -> None:
    """Point the job's Flower app at the recording ServerApp (the rest stays fedge's)."""
    app = job_dir / APP_DIR
    (app / "recording_server.py").write_text(RECORDING_SERVER, encoding="utf-8")
    pyproject = app / "pyproject.toml"
    text = pyproject.read_text(encoding="utf-8")
    fleet_server = 'serverapp = "fedge.aggregator.fleet.server:app"'
    assert fleet_server in text
    pyproject.write_text(
        text.replace(fleet_server, 'serverapp = "recording_server:app"'), encoding="utf-8"
    )


def received(job_dir: Path) -> tuple[list[dict[str, Any]], dict[str, np.ndarray]]:
    """What the ServerApp pulled off the SuperLink (written as it returns)."""
    wait_until((job_dir / "received.json").exists, 30, "the ServerApp's record of replies")
    summary: list[dict[str, Any]] = json.loads(
        (job_dir / "received.json").read_text(encoding="utf-8")
    )
    with np.load(job_dir / "received.npz") as blobs:
        vectors = {k: np.load(io.BytesIO(blobs[k].tobytes())) for k in blobs.files}
    return summary, vectors


def start_stations(
    fh: FleetHome, superlink: SuperLink, supervisors: list[SupernodeSupervisor]
) -> None:
    for edge in EDGES:
        supervisor = SupernodeSupervisor(fh.data_dir(edge) / "supernode")
        supervisors.append(supervisor)
        supervisor.start()
        supervisor.apply(
            SupernodeSpec(
                superlink.address,
                edge,
                fh.data_dir(edge),
                20,
                1,
                60.0,
                trusted_entities=trusted_entities_yaml(fh.home.signing_key().public),
            )
        )


def history(data_dir: Path) -> list[DpRelease]:
    ledger = BudgetLedger(data_dir / LEDGER_FILE)
    try:
        return ledger.history()
    finally:
        ledger.close()


def exhaust_budget(data_dir: Path) -> None:
    """The station spent its lifetime budget in an earlier job (as its agent records it)."""
    apply_budget(data_dir, PrivacyBudget(accounting.epsilon_spent([EARLIER], 1e-3), 1e-3))
    ledger = BudgetLedger(data_dir / LEDGER_FILE)
    try:
        ledger.record("an-earlier-job", 1, EARLIER)
    finally:
        ledger.close()


# Real processes and several rounds: the test's own waits, which say what they waited
# for, should decide that it hung, not pytest's 300 s default.
@pytest.mark.timeout(900)
def test_secagg_with_dp_sgd_on_real_supernodes_survives_a_refusal_and_hides_every_update(
    tmp_path: Path, supervisors: list[SupernodeSupervisor]
) -> None:
    started = time.monotonic()
    fh = make_fleet_home(tmp_path, edges=EDGES)
    publish_trainable(fh, tmp_path, EDGES)
    for index, edge in enumerate(EDGES):
        keep_labelled_images(fh.data_dir(edge), seed=80 + index)
    exhaust_budget(fh.data_dir(REFUSING))
    superlink = SuperLink(tmp_path / "superlink", "127.0.0.1", fh.settings.superlink_port)
    superlink.start()
    try:
        start_stations(fh, superlink, supervisors)
        manifest = tmp_path / "job.toml"
        manifest.write_text(JOB, encoding="utf-8")
        job_dir = tmp_path / "job"
        prepare(manifest, job_dir, fh.home)
        record_what_the_server_receives(job_dir)
        fleet_job.submit(
            job_dir,
            superlink.local_address,
            signing=(fh.home.signing_key(), superlink.signed_apps),
        )
        result = fleet_job.wait(job_dir, timeout_s=300)
        assert result.state.value == "completed", result.error
        print(f"secagg fleet job: {time.monotonic() - started:.1f} s")

        store = RunStore(job_dir / "runs.db")
        try:
            run_id = result.run_id
            (round_1,) = store.rounds(run_id)
            names = store.party_names(run_id)
            party_rounds = store.party_metrics(run_id)
        finally:
            store.close()
        party = {edge: p for p, edge in names.items()}
        # st-04 took part in SecAgg+'s key stages, then refused to train: a dropout whose
        # masks the others' shares removed; the round was unmasked with the other three.
        assert sorted(names[p] for p in round_1["on_time"]) == list(TRAINING), round_1
        assert [names[p] for p in round_1["failed"]] == [REFUSING], round_1
        reason = round_1["failures"][str(party[REFUSING])]
        assert "collect_masked_vectors" in reason and is_budget_exhausted(reason), reason
        assert round_1["quorum_met"], round_1
        assert history(fh.data_dir(REFUSING)) == [EARLIER]  # nothing trained there
        # Metrics are not masked: each station's DP-SGD accounting is in the run store.
        assert sorted(names[r["party"]] for r in party_rounds) == list(TRAINING)
        for row in party_rounds:
            metrics, own = row["metrics"], history(fh.data_dir(names[row["party"]]))
            assert len(own) == 1 and metrics["dp-steps"] == own[0].steps > 0
            assert metrics["dp-epsilon-job"] == pytest.approx(
                accounting.epsilon_spent(own, 1e-3), rel=1e-9
            )
            assert 0 < metrics["dp-epsilon-job"] <= 8.0 + 1e-9
        # The model changed.
        initial = weights_from_bytes((job_dir / "initial.npz").read_bytes())
        final = load_arrays(job_dir / "final.npz")
        assert set(final) == set(initial)
        changed = max(
            float(np.abs(final[k].astype(np.float64) - initial[k].astype(np.float64)).max())
            for k in initial
        )
        assert changed > 1e-4

        # What the deployed ServerApp received: no reply carries a model array ...
        summary, vectors = received(job_dir)
        train = [r for r in summary if r["type"] == "train"]
        # four SecAgg+ stages; st-04 answered two, failed the third, was not asked the last
        assert len(train) == 4 * len(EDGES) - 1
        errors = [r["error"] for r in train if r["error"] is not None]
        assert len(errors) == 1 and is_budget_exhausted(errors[0]), errors
        # st-04 also refuses to evaluate (an evaluation is accounted in its ledger too).
        assert all(is_budget_exhausted(r["error"]) for r in summary if r["error"]), summary
        for reply in summary:
            assert all(count == 0 for count in reply["arrays"].values()), reply
        # ... and each training station's update came only as a masked vector (a factor
        # and one vector per model array), whose values the pairwise masks spread over the
        # modulus: an unmasked quantized update stays below the quantization range.
        masked = [r for r in train if r["numpy"]]
        assert len(masked) == len(TRAINING)
        for reply in masked:
            assert len(reply["numpy"]) == 1 + len(initial)
            values = np.concatenate([vectors[k].ravel() for k in reply["numpy"]])
            assert values.max() >= QUANTIZATION_RANGE, "an unmasked quantized update"
    except BaseException:
        for log in sorted(tmp_path.rglob("*.log")):
            print(f"--- {log}\n{log.read_text(errors='replace')[-3000:]}")
        raise
    finally:
        superlink.stop()
        fh.close()


def test_a_secagg_threshold_above_the_fleets_stations_is_refused_before_anything_runs(
    tmp_path: Path,
) -> None:
    fh = make_fleet_home(tmp_path, edges=EDGES)
    try:
        publish_trainable(fh, tmp_path, edges=TRAINING)  # st-04 does not train
        manifest = tmp_path / "job.toml"
        # edges = "all": the three training stations cannot meet a threshold of four.
        manifest.write_text(JOB.replace("secagg_threshold = 3", "secagg_threshold = 4"))
        job_dir = tmp_path / "job"
        with pytest.raises(ManifestError) as refused:
            prepare(manifest, job_dir, fh.home)
        message = str(refused.value)
        assert "privacy.secagg_threshold (4) is more than the 3 parties" in message
        assert "3 edge(s) of the job have training enabled" in message
        assert not job_dir.exists()  # no job, nothing submitted, nothing trained
        # Named explicitly, the same.
        explicit = JOB.replace('edges = "all"', 'edges = ["st-01", "st-02", "st-03"]')
        manifest.write_text(explicit.replace("secagg_threshold = 3", "secagg_threshold = 4"))
        with pytest.raises(ManifestError, match=r"secagg_threshold \(4\)"):
            prepare(manifest, job_dir, fh.home)
        assert not job_dir.exists()
        # Four training stations meet it (edges = "all" is counted against the fleet).
        with fh.fleet() as fleet:
            fleet.set_training([REFUSING], TrainingPolicy(enabled=True))
        manifest.write_text(JOB.replace("secagg_threshold = 3", "secagg_threshold = 4"))
        assert prepare(manifest, job_dir, fh.home).name == "secagg-fleet"
        assert json.loads((job_dir / "parties.json").read_text()).keys() == set(EDGES)
    finally:
        fh.close()

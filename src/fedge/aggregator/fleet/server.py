"""A fleet job's aggregator: federated rounds across the stations on the fleet's SuperLink.

``fedge aggregator run`` prepares a job directory (:mod:`fedge.federation.fleet_job`) and
submits it with ``flwr run``; the SuperLink starts fedge's ServerApp, which finds
``job-dir`` in its run config and calls :func:`run_fleet_job`. It never reads station
data: the stations train (:mod:`fedge.party.station_app`) and evaluate on their own
held-out images, and only models and metrics cross the network.

Beside the files every job has (:mod:`fedge.aggregator.jobs.directory`)::

    <job_dir>/
        model-spec.json   what the stations build: family, size, classes, preprocessing
        initial.npz       the starting weights (the registry model's, hash-checked)
        parties.json      edge id -> the party id the strategy sees (1000 + index)
        app/              the Flower app ``flwr run`` submits (config: job-dir)

Each round is recorded as it ends (who trained, with how many examples, who was late or
failed and why), then every party evaluates the new model on its held-out images
(``evaluations`` in the run store; round 0 is the starting model), then the round is
checkpointed (model, strategy and tier state). The process holds the job's lock while it
runs; killed, it leaves the newest checkpoint, and a resubmitted run continues from it.
That life (states, resume, records, checkpoints) is the job runner's
(:mod:`fedge.aggregator.jobs.runner`), shared with simulated jobs; this module gives it
the stations on the SuperLink's grid, their own evaluation and the registry's model. An
anomaly job (``[task] family = "anomaly"``) plays its one round of good-part statistics
the same way (:mod:`fedge.aggregator.anomaly.rounds`).

A job in which no station trained in any round (every one refused, for its privacy floor or
budget, or failed) ends FAILED, saying why: its final weights are the starting ones, and
nothing is published (issue 24). Evaluate messages carry the job's id and privacy settings,
so a station accounts (and limits) its evaluations under DP per job.
"""

from __future__ import annotations

import json
import time
from collections.abc import Iterator
from contextlib import contextmanager
from logging import INFO, WARNING
from pathlib import Path
from typing import Any

from flwr.app import (
    ArrayRecord,
    ConfigRecord,
    Context,
    Message,
    MessageType,
    MetricRecord,
    RecordDict,
)
from flwr.serverapp import Grid, ServerApp
from flwr.supercore import log

from fedge.aggregator.anomaly.rounds import anomaly_rounds
from fedge.aggregator.fleet.grids import wait_for_nodes
from fedge.aggregator.fleet.identity import IdentifiedGrid, identify_station
from fedge.aggregator.fleet.manifest import FleetJobManifest, parse_fleet_manifest
from fedge.aggregator.fleet.tier_models import (
    ArchitectureSource,
    distill_inputs,
    tier_finish,
)
from fedge.aggregator.jobs.checkpoint import load_arrays
from fedge.aggregator.jobs.control import ACCURACY_KEY, the_run
from fedge.aggregator.jobs.directory import JOB_MANIFEST, RUNS_DB, JobError, clear_halt, job_lock
from fedge.aggregator.jobs.run_store import PartyEvaluation, RunState, RunStore
from fedge.aggregator.jobs.runner import JobRounds, JobRun, execute_job
from fedge.aggregator.rounds.clock import ClockMode
from fedge.aggregator.rounds.loop import EvaluateFn
from fedge.aggregator.rounds.replies import no_reply_reason, to_array_record
from fedge.aggregator.strategies.factory import LOCAL_STEP_KEYS, TIER_ARCH_KINDS, build_strategy
from fedge.protocols.model_spec import MODEL_SPEC_KEY

JOB_ID_KEY = "job-id"  # what stations account a job's releases to (as a train message)
ARCH_KEY = "arch"  # a distill job's architecture (fedge.party.families.round_spec)
MODEL_SPEC = "model-spec.json"
INITIAL_WEIGHTS = "initial.npz"
PARTIES = "parties.json"
_LOCK_WAIT_S = 30.0  # a resubmitted run may start while the killed one's lock is released


def read_parties(job_dir: Path) -> dict[str, int]:
    data: dict[str, int] = json.loads((job_dir / PARTIES).read_text(encoding="utf-8"))
    return data


def run_fleet_job(
    grid: Grid, job_dir: Path, *, architectures: ArchitectureSource | None = None
) -> None:
    """Run (or continue) the fleet job in ``job_dir`` on ``grid`` until done or halted.

    ``architectures``: the stations' model family at its sizes, which a distill job needs
    (:mod:`fedge.federation.tier_server` passes it; :mod:`.tier_models`)."""
    with job_lock(job_dir, wait_s=_LOCK_WAIT_S):
        manifest = parse_fleet_manifest(
            (job_dir / JOB_MANIFEST).read_text(encoding="utf-8"), source=str(job_dir)
        )
        store = RunStore(job_dir / RUNS_DB)
        try:
            run = the_run(store, job_dir)
            run_id = str(run["run_id"])
            if run.get("state") == RunState.COMPLETED:
                log(INFO, "fleet job %s already completed", run_id)
                return
            if run.get("state") == RunState.HALTED:
                clear_halt(job_dir)  # resuming is the newer request
            parties = read_parties(job_dir)
            store.name_parties(run_id, {party: edge for edge, party in parties.items()})
            job = JobRun(
                job_dir=job_dir,
                store=store,
                run_id=run_id,
                rounds=manifest.job.rounds,
                checkpoint=manifest.checkpoint,
                resume_state={
                    "run_id": run_id,
                    "kind": manifest.kind,
                    "rounds": manifest.job.rounds,
                },
            )

            def untrained() -> str | None:
                reason = no_training(
                    store.rounds(run_id),
                    bool(store.party_metrics(run_id)),
                    store.party_names(run_id),
                )
                if reason is not None:
                    log(WARNING, "fleet job %s failed: %s", run_id, reason)
                return reason

            result = execute_job(
                job,
                lambda: _rounds(grid, job_dir, manifest, store, run_id, parties, architectures),
                verdict=untrained,
            )
            if result.state is RunState.COMPLETED:
                log(INFO, "fleet job %s completed: %d rounds", run_id, manifest.job.rounds)
        finally:
            store.close()


def no_training(
    rounds: list[dict[str, Any]], any_trained: bool, names: dict[int, str]
) -> str | None:
    """Why a job whose rounds ``rounds`` ended is a failure (None: some station trained).

    A model no station trained is the starting one: publishing it as a new version would
    say the fleet learned when it did not."""
    if any_trained:
        return None
    reasons: list[str] = []
    for record in reversed(rounds):
        failures = record.get("failures") or {}
        reasons = [
            f"{names.get(int(party), party)}: {why}" for party, why in sorted(failures.items())
        ]
        if reasons:
            break
    detail = f" (last failures: {'; '.join(reasons)[:600]})" if reasons else ""
    return (
        f"no station trained in any of the job's {len(rounds)} round(s){detail}; nothing is "
        "published. Check the stations' privacy floors and budgets (`fedge edge show EDGE`) "
        "against the job's [privacy] table"
    )


# SecAgg+ scales each station's model by num-examples / max_weight before quantising it to
# 2**22 levels of [-clipping_range, clipping_range]: the larger max_weight, the coarser a
# small station's values (a 13-image station's worst case is ~0.06 at 100,000). A station
# keeps at most Retention.max_images (5,000) labelled images by default; one configured to
# keep more is scaled above 1 (Flower warns) and risks clipping only values beyond 8/ratio.
FLEET_MAX_WEIGHT = 5_000.0


def _rounds(
    grid: Grid,
    job_dir: Path,
    manifest: FleetJobManifest,
    store: RunStore,
    run_id: str,
    parties: dict[str, int],
    architectures: ArchitectureSource | None = None,
) -> JobRounds:
    """The fleet's stations on ``grid``, the job's strategy, and their own evaluation."""
    if manifest.anomaly is not None:  # one round of good-part statistics (issue 28)
        return anomaly_rounds(
            grid,
            job_dir,
            spec_text=(job_dir / MODEL_SPEC).read_text(encoding="utf-8"),
            anomaly=manifest.anomaly,
            backbone_path=job_dir / INITIAL_WEIGHTS,
            parties=parties,
            store=store,
            run_id=run_id,
            wait_for_parties=lambda stations: _wait_for_parties(stations, manifest, len(parties)),
            eval_timeout_s=manifest.federation.eval_timeout_s,
            round_timeout_s=manifest.federation.round_timeout_s,
            max_weight=FLEET_MAX_WEIGHT,
        )
    spec_text = (job_dir / MODEL_SPEC).read_text(encoding="utf-8")
    strategy, extra = build_strategy(
        manifest.kind,
        manifest.strategy_params(),
        per_round=manifest.federation.per_round or len(parties),
        seed=manifest.job.seed,
        clock=ClockMode.WALL,
        **distill_inputs(manifest.kind, job_dir, spec_text, architectures),
    )
    names = {party: edge for edge, party in parties.items()}

    def initial_arrays() -> ArrayRecord:
        return to_array_record(load_arrays(job_dir / INITIAL_WEIGHTS))

    @contextmanager
    def open_grid() -> Iterator[Grid]:
        stations = IdentifiedGrid(grid, identify=identify_station(parties), unidentified="exclude")
        _wait_for_parties(stations, manifest, len(parties))
        yield stations

    # Stations account (and, under DP, limit) their evaluations per job: they need its id
    # and privacy settings, as a train message has them.
    eval_config: dict[str, str | float | int | bool] = {
        MODEL_SPEC_KEY: spec_text,
        JOB_ID_KEY: run_id,
        **strategy.privacy.to_config(),
    }
    if manifest.kind in TIER_ARCH_KINDS:  # the model evaluated is the largest architecture's
        eval_config[ARCH_KEY] = str(extra[ARCH_KEY])

    def evaluation(stations: Grid) -> EvaluateFn:
        def evaluate(server_round: int, model: ArrayRecord) -> MetricRecord:
            results = _evaluate_on_stations(
                stations, model, eval_config, manifest.federation.eval_timeout_s, names
            )
            store.record_evaluation(run_id, server_round, results)
            scored = [(r.accuracy, r.examples) for r in results if r.accuracy is not None]
            metrics: dict[str, float] = {"stations-evaluated": float(len(scored))}
            examples = sum(n for _, n in scored)
            if examples:
                metrics[ACCURACY_KEY] = sum(acc * n for acc, n in scored) / examples
            return MetricRecord(dict(metrics))

        return evaluate

    config = ConfigRecord(
        {
            MODEL_SPEC_KEY: spec_text,
            "lr": manifest.task.lr,
            "local-epochs": manifest.task.local_epochs,
            "batch-size": manifest.task.batch_size,
            # a strategy's own local step over the task's (e.g. DP-SGD's larger batch)
            **{k: v for k, v in extra.items() if k in LOCAL_STEP_KEYS},
        }
    )
    return JobRounds(
        strategy=strategy,
        initial_arrays=initial_arrays,
        open_grid=open_grid,
        evaluation=evaluation,
        train_config=config,
        round_timeout_s=manifest.federation.round_timeout_s,
        max_weight=FLEET_MAX_WEIGHT,
        finish=tier_finish(job_dir, parties),
    )


def _wait_for_parties(grid: IdentifiedGrid, manifest: FleetJobManifest, parties: int) -> None:
    wanted = manifest.federation.min_parties or parties
    seen = wait_for_nodes(grid, wanted, manifest.federation.node_wait_s)
    if seen < wanted:
        excluded = "; ".join(f"node {n}: {why}" for n, why in grid.excluded.items())
        raise JobError(
            f"only {seen} of {wanted} stations connected to the SuperLink within "
            f"{manifest.federation.node_wait_s:.0f}s (is training enabled on them? "
            f"`fedge edge set-training EDGE --enable`){'; ' + excluded if excluded else ''}"
        )


def _evaluate_on_stations(
    grid: Grid,
    model: ArrayRecord,
    config: dict[str, str | float | int | bool],
    timeout_s: float,
    names: dict[int, str],
) -> list[PartyEvaluation]:
    """Every connected station evaluates ``model`` on its held-out images."""
    nodes = list(grid.get_node_ids())
    messages = [
        Message(
            RecordDict({"arrays": model, "config": ConfigRecord(dict(config))}),
            dst_node_id=node,
            message_type=MessageType.EVALUATE,
        )
        for node in nodes
    ]
    replies, delivered, waited_s = _send_and_receive(grid, messages, timeout_s)
    results = []
    for node in nodes:
        name = names.get(node, str(node))
        reply = replies.get(node)
        if reply is None:
            reason = no_reply_reason(waited_s, timeout_s, delivered=node in delivered)
            results.append(PartyEvaluation(name, None, 0, reason))
        elif reply.has_error():
            reason = str(reply.error.reason)
            log(WARNING, "station %s could not evaluate: %s", name, reason[:300])
            results.append(PartyEvaluation(name, None, 0, reason[:500]))
        else:
            metrics: dict[str, Any] = dict(reply.content.metric_records.get("metrics", {}))
            accuracy, examples = metrics.get("eval-acc"), metrics.get("num-examples")
            # What a station reports is data to check, not to trust.
            if (
                not isinstance(accuracy, int | float)
                or isinstance(accuracy, bool)
                or not 0.0 <= float(accuracy) <= 1.0
                or not isinstance(examples, int)
                or isinstance(examples, bool)
                or examples < 0
            ):
                reason = f"malformed evaluation: eval-acc={accuracy!r}, num-examples={examples!r}"
                results.append(PartyEvaluation(name, None, 0, reason))
                continue
            results.append(PartyEvaluation(name, float(accuracy), examples))
    return results


def _send_and_receive(
    grid: Grid, messages: list[Message], timeout_s: float, pull_interval_s: float = 0.2
) -> tuple[dict[int, Message], set[int], float]:
    """Flower's ``send_and_receive``, saying which messages the SuperLink took and how
    long it really waited: (replies by node, nodes delivered to, seconds waited)."""
    started = time.monotonic()
    pushed = list(grid.push_messages(messages))
    waiting = {mid: m.metadata.dst_node_id for mid, m in zip(pushed, messages, strict=True) if mid}
    delivered = set(waiting.values())
    replies: dict[int, Message] = {}
    while waiting and time.monotonic() - started < timeout_s:
        for reply in grid.pull_messages(list(waiting)):
            node = waiting.pop(reply.metadata.reply_to_message_id, None)
            if node is not None:
                replies[node] = reply
        if waiting:
            time.sleep(pull_interval_s)
    return replies, delivered, time.monotonic() - started


# ---------------------------------------------------------------- the Flower adapter

JOB_DIR_KEY = "job-dir"
app = ServerApp()


@app.main()
def main(grid: Grid, context: Context) -> None:
    """Run the fleet job whose directory the run config names (``job-dir``)."""
    job_dir = context.run_config.get(JOB_DIR_KEY)
    if not isinstance(job_dir, str) or not job_dir:
        raise JobError(f"run_config[{JOB_DIR_KEY!r}] must name a fleet job's directory")
    run_fleet_job(grid, Path(job_dir))

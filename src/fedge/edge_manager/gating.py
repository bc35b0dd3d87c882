"""The validation gate at the manager: ask the stations, wait, decide, record.

``fedge model gate inspect:4`` (and the continuous-training loop) call this module:

1. :func:`start` checks everything first -- the candidate is published and intact, every
   chosen edge's serving model has the candidate's classes, the edges have labels --
   then writes a signed :class:`~fedge.protocols.evaluation.EvaluationRequest` per edge
   as a desired document of kind ``evaluate``; the serve loop publishes it (retained),
   and a station without MQTT fetches it over gRPC, like a deployment.
2. :func:`progress` reads which stations answered (``edge_manager/evaluations.py``
   stores the reports); a station whose request was replaced by a newer evaluation is
   "superseded" (one evaluation per station at a time: the newest wins).
3. :func:`decide` judges (:mod:`fedge.edge_manager.gate`, against the manager's current
   labels) and stores the verdict and its evidence in ``gate_results``: the model's
   lineage record of blessing. A model is blessed iff its newest row says so.

:func:`run` does the three with a timeout; stations that did not answer in time are
named in the evidence.
"""

import json
import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass
from typing import Any

from fedge.edge_manager import evaluations
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.evaluations import EVALUATE, ReportRow
from fedge.edge_manager.fleet import Fleet
from fedge.edge_manager.gate import GatePolicy, StationReport, Verdict, judge
from fedge.edge_manager.home import is_wildcard
from fedge.edge_manager.registry import PublishedModel, parse_ref
from fedge.edge_manager.store import Store
from fedge.protocols import codec
from fedge.protocols.evaluation import MAX_IMAGES, EvaluationRequest


@dataclass(frozen=True)
class GateRequest:
    """An evaluation under way: its id, the candidate, and each edge's serving model
    (None: the edge serves nothing). JSON round trip for a caller that must resume."""

    eval_id: str
    candidate: str
    serving: dict[str, str | None]
    started_at: float

    def to_json(self) -> str:
        return json.dumps(self.__dict__, sort_keys=True)

    @classmethod
    def from_json(cls, text: str) -> "GateRequest":
        data = json.loads(text)
        return cls(
            str(data["eval_id"]),
            str(data["candidate"]),
            {str(k): None if v is None else str(v) for k, v in data["serving"].items()},
            float(data["started_at"]),
        )


@dataclass(frozen=True)
class Progress:
    answered: dict[str, ReportRow]
    pending: tuple[str, ...]
    superseded: dict[str, str]  # edge -> the evaluation that replaced this one there

    @property
    def done(self) -> bool:
        return not self.pending


@dataclass(frozen=True)
class StoredVerdict:
    name: str
    version: int
    blessed: bool
    evidence: dict[str, Any]
    eval_id: str
    at: float


def _edges_with_labels(fleet: Fleet) -> set[str]:
    return {str(r["edge"]) for r in fleet.store.query("SELECT DISTINCT edge FROM labels")}


def _serving(fleet: Fleet, edge: str) -> str | None:
    row = fleet.store.one("SELECT serving FROM edges WHERE edge=?", (edge,))
    serving = "" if row is None else str(row["serving"] or "")
    return serving or None


def plan(
    fleet: Fleet, candidate: str, edges: list[str] | None = None
) -> tuple[PublishedModel, dict[str, PublishedModel | None]]:
    """Check a gate of ``candidate`` on ``edges`` (default: every edge with labels);
    return the candidate and each edge's serving model. Raises ManagerError (nothing
    written) for an unknown or damaged model, unknown edges, edges without labels, a
    serving model that is not in the registry or has other classes."""
    name, version = parse_ref(candidate)
    model = fleet.registry.get(name, version)  # UnknownModelError names the ref
    model.verify()
    labelled = _edges_with_labels(fleet)
    if edges is None:
        chosen = [edge for edge in fleet.edges() if edge in labelled]
        if not chosen:
            raise ManagerError(
                "no edge has labelled predictions, so no station has held-out labels to "
                "evaluate on; label some with `fedge labels add` (or on the station), "
                "then gate again; nothing was started"
            )
    else:
        chosen = fleet.edges(edges)
        unlabelled = [edge for edge in chosen if edge not in labelled]
        if unlabelled:
            raise ManagerError(
                f"{', '.join(unlabelled)} has no labelled predictions, so no held-out "
                "labels to evaluate on; label some, or leave it out of --edges; nothing "
                "was started"
            )
    serving: dict[str, PublishedModel | None] = {}
    for edge in chosen:
        ref = _serving(fleet, edge)
        if ref is None:
            serving[edge] = None
            continue
        try:
            theirs_model = fleet.registry.get(*parse_ref(ref))
        except ManagerError:
            raise ManagerError(
                f"{edge} serves {ref}, which is not in this registry; deploy a published "
                "model to it first; nothing was started"
            ) from None
        serving[edge] = theirs_model
        theirs = theirs_model.manifest.classes
        if theirs != model.manifest.classes:
            raise ManagerError(
                f"{candidate} has classes {','.join(model.manifest.classes)} but {edge} "
                f"serves {ref} with {','.join(theirs)}: the gate compares models of the "
                "same classes; nothing was started"
            )
    return model, serving


def start(
    fleet: Fleet,
    candidate: str,
    edges: list[str] | None = None,
    *,
    max_images: int = MAX_IMAGES,
    augment: int | None = None,
    now: float | None = None,
) -> GateRequest:
    """Check (:func:`plan`), then write one evaluation request per edge.

    ``augment``: re-lit copies per held-out image the stations also score, for the MPP
    fit (None: the station's default, and a request an older station still reads)."""
    if is_wildcard(fleet.grpc_target.rpartition(":")[0]):  # stations fetch the model there
        raise ManagerError(
            f"stations cannot fetch a model from {fleet.grpc_target}, a wildcard address; "
            "set the address agents reach this manager at with `fedge manager advertise HOST`"
        )
    model, serving = plan(fleet, candidate, edges)
    eval_id = f"ev-{uuid.uuid4().hex[:12]}"
    now = time.time() if now is None else now
    # The caller's transaction if one is open (the loop records its step with it).
    writing = nullcontext() if fleet.store.conn.in_transaction else fleet.store.transaction()
    with writing:
        for edge, theirs in serving.items():
            envelopes = [model.envelope.decode()]
            if theirs is not None and theirs.manifest.ref != model.manifest.ref:
                envelopes.append(theirs.envelope.decode())
            current = fleet.store.scalar(
                "SELECT max(version) FROM desired WHERE edge=? AND kind=?", (edge, EVALUATE)
            )
            request = EvaluationRequest(
                fleet=fleet.fleet,
                edge=edge,
                version=int(current or 0) + 1,
                eval_id=eval_id,
                manifest_envelopes=tuple(envelopes),
                grpc_target=fleet.grpc_target,
                max_images=max_images,
                issued_at=now,
                augment=augment,
            )
            fleet.write_desired(edge, EVALUATE, request.version, codec.encode(request), now)
    return GateRequest(
        eval_id,
        model.manifest.ref,
        {edge: None if m is None else m.manifest.ref for edge, m in serving.items()},
        now,
    )


def progress(store: Store, request: GateRequest) -> Progress:
    answered = {
        edge: row
        for edge, row in evaluations.reports(store, request.eval_id).items()
        if edge in request.serving
    }
    superseded: dict[str, str] = {}
    pending = []
    for edge in sorted(request.serving):
        if edge in answered:
            continue
        latest = store.scalar(
            "SELECT json_extract(document, '$.eval_id') FROM desired WHERE edge=? AND kind=? "
            "ORDER BY version DESC LIMIT 1",
            (edge, EVALUATE),
        )
        if latest is not None and latest != request.eval_id:
            superseded[edge] = str(latest)
        else:
            pending.append(edge)
    return Progress(answered, tuple(pending), superseded)


def decide(
    fleet: Fleet, request: GateRequest, policy: GatePolicy, *, now: float | None = None
) -> Verdict:
    """Judge what the stations reported so far and store the verdict in ``gate_results``."""
    store = fleet.store
    state = progress(store, request)
    stations = []
    for edge, serving in sorted(request.serving.items()):
        if edge in state.superseded:
            why = f"superseded by evaluation {state.superseded[edge]}"
            stations.append(StationReport(edge, serving, "missing", why))
            continue
        row = state.answered.get(edge)
        stations.append(evaluations.station_report(store, request.eval_id, edge, serving, row))
    ids = {item.prediction_id for station in stations for item in station.items}
    labels = evaluations.manager_labels(store, ids)
    name, version = parse_ref(request.candidate)
    manifest = fleet.registry.get(name, version).manifest
    # The defect classes as the agent decides them: declared, else all but the first.
    positives = manifest.positive_classes or manifest.classes[1:]
    verdict = judge(request.candidate, stations, labels, policy, positives)
    decided_at = time.time() if now is None else now
    evidence = {
        **verdict.evidence(),
        "eval_id": request.eval_id,
        "started_at": request.started_at,
        "decided_at": decided_at,
        "not_answered": list(state.pending),
        "superseded": state.superseded,
    }
    writing = nullcontext() if store.conn.in_transaction else store.transaction()
    with writing:
        store.conn.execute(
            "INSERT INTO gate_results (name, version, blessed, evidence, eval_id, at) "
            "VALUES (?,?,?,?,?,?)",
            (
                name,
                version,
                int(verdict.blessed),
                json.dumps(evidence, sort_keys=True),
                request.eval_id,
                decided_at,
            ),
        )
    return verdict


def run(
    fleet: Fleet,
    candidate: str,
    policy: GatePolicy,
    *,
    edges: list[str] | None = None,
    timeout_s: float = 300.0,
    max_images: int = MAX_IMAGES,
    augment: int | None = None,
    on_progress: Callable[[GateRequest, Progress], None] | None = None,
    poll_s: float = 0.2,
) -> tuple[GateRequest, Verdict]:
    """Start an evaluation, wait for every station (at most ``timeout_s``), decide."""
    request = start(fleet, candidate, edges, max_images=max_images, augment=augment)
    deadline = time.monotonic() + timeout_s
    while True:
        state = progress(fleet.store, request)
        if on_progress is not None:
            on_progress(request, state)
        if state.done or time.monotonic() >= deadline:
            break
        time.sleep(poll_s)  # the serve process stores the reports: poll the store
    return request, decide(fleet, request, policy)


def stored(store: Store, name: str, version: int) -> StoredVerdict | None:
    """The newest verdict on ``name:version`` (a model is blessed iff it says so)."""
    row = store.one(
        "SELECT blessed, evidence, eval_id, at FROM gate_results WHERE name=? AND version=? "
        "ORDER BY at DESC LIMIT 1",
        (name, version),
    )
    if row is None:
        return None
    return StoredVerdict(
        name,
        version,
        bool(row["blessed"]),
        json.loads(str(row["evidence"])),
        str(row["eval_id"]),
        float(row["at"]),
    )

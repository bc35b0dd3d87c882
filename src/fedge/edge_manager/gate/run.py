"""The validation gate at the manager: ask the stations, wait, decide, record.

``fedge model gate inspect:4`` (and the continuous-training loop) call this module:

1. :func:`start` checks everything first -- the candidate is published and intact, every
   chosen edge's serving model has the candidate's classes, the edges have labels, no
   evaluation is still pending on them -- then writes a signed
   :class:`~fedge.protocols.evaluation.EvaluationRequest` per edge as a desired document
   of kind ``evaluate``; the serve loop publishes it (retained), and a station without
   MQTT fetches it over gRPC, like a deployment.
2. :func:`progress` reads which stations answered (``edge_manager/gate/reports.py``
   stores the reports); a station whose request was replaced by a newer evaluation is
   "superseded" (one evaluation per station at a time: the newest wins).
3. :func:`decide` judges (:mod:`fedge.edge_manager.gate.verdict`, against the manager's current
   labels) and stores the verdict and its evidence in ``gate_results``: the model's
   lineage record of blessing. A model is blessed iff its newest row says so.

:func:`run` does the three with a timeout; stations that did not answer in time are
named in the evidence.

Because the newest ``gate_results`` row decides whether a model is blessed, a row is
written only from stations' answers: a gate on edges where another evaluation is still
pending is refused (one evaluation per station; a pending one older than
``pending_timeout_s`` is taken as abandoned and named in the new evidence), an edge
that already serves the candidate is left out (comparing a model with itself finds no
gain and would un-bless the model it serves), and :func:`decide` raises
:class:`NoVerdictError`, writing nothing, when no station answered.
"""

import time
import uuid
from collections.abc import Callable
from contextlib import nullcontext
from dataclasses import dataclass, field

from fedge.edge_manager.desired import store as desired_store
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import edge_store
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.gate import reports as evaluations
from fedge.edge_manager.gate import store as evaluation_store
from fedge.edge_manager.gate.reports import EVALUATE, ReportRow, pending
from fedge.edge_manager.gate.store import StoredVerdict as StoredVerdict
from fedge.edge_manager.gate.verdict import GatePolicy, StationReport, Verdict, judge
from fedge.edge_manager.home.layout import is_wildcard
from fedge.edge_manager.labels import store as label_store
from fedge.edge_manager.registry.versions import PublishedModel, parse_ref
from fedge.edge_manager.store import Store
from fedge.protocols import codec
from fedge.protocols.evaluation import MAX_IMAGES, EvaluationRequest


@dataclass(frozen=True)
class GateRequest:
    """An evaluation under way (held by the caller that waits for it; not stored): its
    id, the candidate, each asked edge's serving model (None: the edge serves nothing),
    the edges left out (edge -> why) and the pending evaluations it took as abandoned
    (edge -> that evaluation's id)."""

    eval_id: str
    candidate: str
    serving: dict[str, str | None]
    started_at: float
    left_out: dict[str, str] = field(default_factory=dict)
    abandoned: dict[str, str] = field(default_factory=dict)


@dataclass(frozen=True)
class Progress:
    answered: dict[str, ReportRow]
    pending: tuple[str, ...]
    superseded: dict[str, str]  # edge -> the evaluation that replaced this one there

    @property
    def done(self) -> bool:
        return not self.pending


class NoVerdictError(ManagerError):
    """No station answered an evaluation: there is nothing to judge and nothing is
    recorded (the model's stored verdict stands)."""


@dataclass(frozen=True)
class GatePlan:
    """What :func:`plan` found: the candidate, each edge's serving model, and the edges
    left out (edge -> why)."""

    model: PublishedModel
    serving: dict[str, PublishedModel | None]
    left_out: dict[str, str]


SERVES_CANDIDATE = "serves the candidate already"
# How long a pending evaluation blocks a new one on its edges: a gate that waited this
# long has decided, so an evaluation still unanswered and undecided after it was
# abandoned (its caller died). The default wait of `run` and `fedge model gate`.
DEFAULT_TIMEOUT_S = 300.0


def plan(
    fleet: Fleet,
    candidate: str,
    edges: list[str] | None = None,
    *,
    now: float | None = None,
    pending_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> GatePlan:
    """Check a gate of ``candidate`` on ``edges`` (default: every edge with labels).
    Raises ManagerError (nothing written) for an unknown or damaged model, unknown
    edges, edges without labels, a serving model that is not in the registry or has
    other classes, an evaluation still pending on a chosen edge, or every chosen edge
    serving the candidate already (those edges are left out otherwise)."""
    name, version = parse_ref(candidate)
    model = fleet.registry.get(name, version)  # UnknownModelError names the ref
    model.verify()
    labelled = label_store.labelled_edges(fleet.store)
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
    left_out: dict[str, str] = {}
    for edge in chosen:
        ref = edge_store.serving(fleet.store.conn, edge) or None
        if ref is None:
            serving[edge] = None
            continue
        if ref == model.manifest.ref:
            left_out[edge] = SERVES_CANDIDATE
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
    if not serving:
        found = stored(fleet.store, name, version)
        standing = (
            "it has not been gated"
            if found is None
            else f"its stored verdict stands ({'blessed' if found.blessed else 'not blessed'})"
        )
        raise ManagerError(
            f"{', '.join(sorted(left_out))} {SERVES_CANDIDATE} ({model.manifest.ref}): "
            f"comparing a model with itself judges nothing, so {standing}; gate it on "
            "edges that serve another model; nothing was started"
        )
    now = time.time() if now is None else now
    blocking = [p for p in pending(fleet.store, serving) if now - p.issued_at < pending_timeout_s]
    if blocking:
        named = "; ".join(
            f"{p.edge}: evaluation {p.eval_id} of {p.candidate}, started "
            f"{now - p.issued_at:.0f} s ago"
            for p in blocking
        )
        raise ManagerError(
            f"an evaluation is still pending ({named}); a station answers one evaluation "
            f"at a time: wait for it (it is taken as abandoned {pending_timeout_s:g} s "
            "after it started) or leave those edges out of --edges; nothing was started"
        )
    return GatePlan(model, serving, left_out)


def start(
    fleet: Fleet,
    candidate: str,
    edges: list[str] | None = None,
    *,
    max_images: int = MAX_IMAGES,
    augment: int | None = None,
    now: float | None = None,
    pending_timeout_s: float = DEFAULT_TIMEOUT_S,
) -> GateRequest:
    """Check (:func:`plan`), then write one evaluation request per edge.

    ``augment``: re-lit copies per held-out image the stations also score, for the MPP
    fit (None: the station's default, and a request an older station still reads).
    An evaluation pending on a chosen edge for less than ``pending_timeout_s`` refuses
    the gate; an older one is abandoned (named in the new gate's evidence)."""
    if is_wildcard(fleet.grpc_target.rpartition(":")[0]):  # stations fetch the model there
        raise ManagerError(
            f"stations cannot fetch a model from {fleet.grpc_target}, a wildcard address; "
            "set the address agents reach this manager at with `fedge manager advertise HOST`"
        )
    now = time.time() if now is None else now
    checked = plan(fleet, candidate, edges, now=now, pending_timeout_s=pending_timeout_s)
    model = checked.model
    abandoned = {p.edge: p.eval_id for p in pending(fleet.store, checked.serving)}
    eval_id = f"ev-{uuid.uuid4().hex[:12]}"
    # The caller's transaction if one is open (the loop records its step with it).
    writing = nullcontext() if fleet.store.conn.in_transaction else fleet.store.transaction()
    with writing:
        for edge, theirs in checked.serving.items():
            envelopes = [model.envelope.decode()]
            if theirs is not None:
                envelopes.append(theirs.envelope.decode())
            current = desired_store.latest_version(fleet.store, edge, EVALUATE)
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
        {edge: None if m is None else m.manifest.ref for edge, m in checked.serving.items()},
        now,
        dict(checked.left_out),
        abandoned,
    )


def progress(store: Store, request: GateRequest) -> Progress:
    answered = {
        edge: row
        for edge, row in evaluations.reports(store, request.eval_id).items()
        if edge in request.serving
    }
    superseded: dict[str, str] = {}
    waiting = []
    for edge in sorted(request.serving):
        if edge in answered:
            continue
        latest = evaluation_store.latest_eval_id(store, edge)
        if latest is not None and latest != request.eval_id:
            superseded[edge] = latest
        else:
            waiting.append(edge)
    return Progress(answered, tuple(waiting), superseded)


def decide(
    fleet: Fleet, request: GateRequest, policy: GatePolicy, *, now: float | None = None
) -> Verdict:
    """Judge what the stations reported so far and store the verdict in ``gate_results``.

    Raises :class:`NoVerdictError`, writing nothing, when no station answered (each was
    superseded or is still silent): that is no evidence about the candidate, and a
    stored "not blessed" would un-bless it."""
    store = fleet.store
    state = progress(store, request)
    if not state.answered:
        silent = [f"{e} (superseded by evaluation {i})" for e, i in state.superseded.items()]
        silent += [f"{e} (did not answer)" for e in state.pending]
        raise NoVerdictError(
            f"no verdict on {request.candidate}: no station answered evaluation "
            f"{request.eval_id} ({', '.join(sorted(silent))}); nothing was recorded and its "
            "stored verdict stands; gate it again once the stations are online"
        )
    stations = [
        StationReport(edge, request.candidate, "left_out", why)
        for edge, why in sorted(request.left_out.items())
    ]
    labels: dict[str, str] = {}
    for edge, serving in sorted(request.serving.items()):
        if edge in state.superseded:
            why = f"superseded by evaluation {state.superseded[edge]}"
            stations.append(StationReport(edge, serving, "missing", why))
            continue
        row = state.answered.get(edge)
        station = evaluations.station_report(store, request.eval_id, edge, serving, row)
        stations.append(station)
        ids = {item.prediction_id for item in station.items}
        labels.update(evaluations.manager_labels(store, edge, ids))
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
        "left_out": request.left_out,
        "abandoned": request.abandoned,
    }
    writing = nullcontext() if store.conn.in_transaction else store.transaction()
    with writing:
        evaluation_store.add_verdict(
            store.conn,
            StoredVerdict(name, version, verdict.blessed, evidence, request.eval_id, decided_at),
        )
    return verdict


def run(
    fleet: Fleet,
    candidate: str,
    policy: GatePolicy,
    *,
    edges: list[str] | None = None,
    timeout_s: float = DEFAULT_TIMEOUT_S,
    max_images: int = MAX_IMAGES,
    augment: int | None = None,
    on_progress: Callable[[GateRequest, Progress], None] | None = None,
    poll_s: float = 0.2,
) -> tuple[GateRequest, Verdict]:
    """Start an evaluation, wait for every station (at most ``timeout_s``), decide.
    Raises ManagerError when refused (nothing started) and :class:`NoVerdictError`
    when no station answered (nothing recorded)."""
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


def stored(
    store: Store, name: str, version: int, eval_id: str | None = None
) -> StoredVerdict | None:
    """The newest verdict on ``name:version`` (a model is blessed iff it says so), or
    the verdict of evaluation ``eval_id`` when given."""
    return evaluation_store.verdict(store, name, version, eval_id)

"""A station's image beside its label (issue 30, item 3): viewed on demand, audited.

``GET /edges/{edge}/images/{prediction_id}`` asks the station through the manager
(edge_manager/viewing/: the manager's certificate against the agent's image endpoint,
over the fleet's mutual TLS) and relays the bytes to the browser: nothing is written at
the manager but the audit entry (who, which prediction, which station, when, how it
ended). The manager asks only when the station's desired signed config allows operator
viewing; the station checks its own signed copy again. A view that fails says why in
words the page shows (policy off, unknown prediction, pruned, station offline within the
deadline, an oversized reply) and is counted in :attr:`ImageViews.counters`.

Operator viewing is set per station by an admin (``POST /edges/{edge}/viewing``, as
``fedge edge set-viewing``), a new signed config version; the edge page shows it.
"""

import json
import time
from collections import Counter
from collections.abc import Mapping
from dataclasses import dataclass

from starlette.concurrency import run_in_threadpool
from starlette.responses import Response

from fedge.console.audit import Outcome
from fedge.console.errors import BadInput
from fedge.edge_manager.fleet import prediction_store
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.viewing import store as viewing_store
from fedge.edge_manager.viewing.client import (
    DEFAULT_TIMEOUT_S,
    StationImage,
    ViewError,
    ViewFailure,
    fetch_image,
)
from fedge.edge_manager.viewing.policy import EXPLAIN, NotAsked, ViewFacts, allows_viewing, decide
from fedge.protocols import validate
from fedge.protocols.errors import ProtocolError
from fedge.protocols.pki import TlsFiles
from fedge.protocols.viewing import Refusal

VIEWING_FIELDS = frozenset({"csrf", "viewing"})
CHOICES = {"allow": True, "deny": False}
# The station's refusals and the manager's own, as the status the browser gets.
STATUS = {
    NotAsked.UNKNOWN_EDGE: 404,
    NotAsked.UNKNOWN_PREDICTION: 404,
    NotAsked.POLICY_OFF: 403,
    NotAsked.NO_ENDPOINT: 409,
    ViewFailure.OFFLINE: 504,
    ViewFailure.TOO_LARGE: 502,
    ViewFailure.IMPOSTOR: 502,
    ViewFailure.BAD_REPLY: 502,
}
REFUSED_STATUS = {Refusal.POLICY_OFF: 403, Refusal.UNKNOWN: 404, Refusal.PRUNED: 410}


@dataclass(frozen=True)
class StationViewing:
    """What the edge page and the label queue say of a station's images."""

    edge: str
    allowed: bool  # its newest desired signed config allows operator viewing
    images_at: str  # where it serves them ('' : it states none)

    @property
    def words(self) -> str:
        if not self.allowed:
            return "off: its images stay on the station (label there, or an admin allows viewing)"
        if not self.images_at:
            return "allowed, but the station states no image address (set image_port in agent.toml)"
        return f"allowed: shown on demand from {self.images_at}, never stored at the manager"


def station_viewing(fleet: Fleet, edges: list[str]) -> dict[str, StationViewing]:
    endpoints = viewing_store.endpoints(fleet.store)
    return {
        edge: StationViewing(
            edge,
            allows_viewing(fleet.desired_config(edge)),
            endpoints[edge].images_at if edge in endpoints else "",
        )
        for edge in edges
    }


def parse_viewing(form: Mapping[str, str]) -> bool:
    extra = sorted(set(form) - VIEWING_FIELDS)
    if extra:
        raise BadInput(f"the form sent fields it does not have ({', '.join(extra)}); reload it")
    choice = form.get("viewing", "")
    if choice not in CHOICES:
        raise BadInput(f"viewing must be one of {', '.join(CHOICES)}, not {choice!r}")
    return CHOICES[choice]


def set_viewing(fleet: Fleet, edge: str, allowed: bool) -> str:
    (pushed,) = fleet.set_viewing([edge], allowed)
    what = "operators may view its images on demand" if allowed else "its images stay on it"
    return f"{pushed.edge}: desired config v{pushed.version} ({what})"


@dataclass(frozen=True)
class Asked:
    """The manager's decision on a view, and where to ask."""

    not_asked: NotAsked | None
    images_at: str


def ask(fleet: Fleet, edge: str, prediction_id: str) -> Asked:
    """Read the facts (in the store's thread) and decide whether to ask the station."""
    endpoint = viewing_store.endpoint(fleet.store, edge)
    scored = prediction_store.scored_by(fleet.store, prediction_id)
    facts = ViewFacts(
        edge_enrolled=endpoint is not None,
        scored_by=None if scored is None else scored.edge,
        edge=edge,
        desired=fleet.desired_config(edge) if endpoint is not None else None,
        images_at="" if endpoint is None else endpoint.images_at,
    )
    return Asked(decide(facts), facts.images_at)


@dataclass(frozen=True)
class ViewOutcome:
    """One view as the audit log keeps it and the browser gets it."""

    status: int
    detail: str  # for the audit log and the page: bytes sent, or why not
    image: StationImage | None
    reason: str  # 'shown', a NotAsked, a ViewFailure or a station's Refusal


class ImageViews:
    """The console's image views; the counters say how each ended since start."""

    def __init__(self, files: TlsFiles | None, timeout_s: float = DEFAULT_TIMEOUT_S) -> None:
        self.files = files  # the manager's client certificate; None: an --insecure home
        self.timeout_s = timeout_s
        self.counters: Counter[str] = Counter()

    def check(self, edge: str, prediction_id: str) -> str | None:
        """Why the path itself is bad (None: fine)."""
        try:
            validate.identifier(edge, "edge")
            validate.identifier(prediction_id, "prediction_id")
        except ProtocolError as exc:
            return str(exc)
        return None

    def fetch(self, edge: str, prediction_id: str, asked: Asked) -> ViewOutcome:
        """Ask the station (a blocking call: run it in a worker thread)."""
        outcome = self._fetch(edge, prediction_id, asked)
        self.counters[f"views.{outcome.reason}"] += 1
        return outcome

    def _fetch(self, edge: str, prediction_id: str, asked: Asked) -> ViewOutcome:
        if asked.not_asked is not None:
            why = asked.not_asked
            return ViewOutcome(STATUS[why], EXPLAIN[why], None, why.value)
        if self.files is None:
            return ViewOutcome(
                409, "this home has no fleet certificates (--insecure): no image views", None,
                "insecure",
            )  # fmt: skip
        started = time.perf_counter()
        try:
            image = fetch_image(
                self.files, edge, asked.images_at, prediction_id, timeout_s=self.timeout_s
            )
        except ViewError as exc:
            if exc.refusal is not None:
                status = REFUSED_STATUS.get(exc.refusal, 502)
                return ViewOutcome(status, str(exc), None, exc.refusal.value)
            return ViewOutcome(STATUS.get(exc.kind, 502), str(exc), None, exc.kind.value)
        ms = (time.perf_counter() - started) * 1000
        detail = f"{len(image.data)} bytes from {edge} in {ms:.0f} ms"
        return ViewOutcome(200, detail, image, "shown")


def reply(outcome: ViewOutcome) -> Response:
    """The image (kept by no cache: the console's headers say no-store), or why not."""
    if outcome.image is not None:
        return Response(outcome.image.data, media_type=outcome.image.media_type)
    body = json.dumps({"error": outcome.detail, "reason": outcome.reason})
    return Response(body, status_code=outcome.status, media_type="application/json")


async def fetch(views: ImageViews, edge: str, prediction_id: str, asked: Asked) -> ViewOutcome:
    return await run_in_threadpool(views.fetch, edge, prediction_id, asked)


def audit_outcome(outcome: ViewOutcome) -> Outcome:
    """Shown; refused by a policy (the manager's or the station's); a bad id; or failed."""
    if outcome.image is not None:
        return Outcome.DONE
    if outcome.reason in (NotAsked.POLICY_OFF.value, Refusal.POLICY_OFF.value):
        return Outcome.REFUSED
    if outcome.reason in (NotAsked.UNKNOWN_EDGE.value, NotAsked.UNKNOWN_PREDICTION.value):
        return Outcome.INVALID
    if outcome.reason == Refusal.UNKNOWN.value:
        return Outcome.INVALID
    return Outcome.FAILED


def manager_files(home: ManagerHome) -> TlsFiles | None:
    """The manager's client certificate, with the fleet's CRL (a revoked station is not
    asked); None for a home without a fleet CA (--insecure)."""
    fleet_pki = home.pki()
    if not fleet_pki.ca_path.exists():
        return None
    files = fleet_pki.manager_files()
    return TlsFiles(files.ca, files.cert, files.key, crl=fleet_pki.crl_path)

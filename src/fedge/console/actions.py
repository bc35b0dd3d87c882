"""What operators change from the console, through the same library calls as the CLI.

A threshold is ``Fleet.set_threshold`` (a new signed config version, as ``fedge edge
set-threshold``); sharing thumbnails is ``Fleet.set_thumbnails`` (as ``fedge edge
set-thumbnails``, an admin's decision); a label is ``Fleet.add_label`` (stored, then
sent down to the station, as ``fedge labels add``); a rollout is paused, resumed or
aborted through ``Rollouts`` (as ``fedge rollout pause|resume|abort``). Form fields are
parsed here into typed values first: a field that is malformed or not one the form can
send raises :class:`BadInput`, and the library's own checks (range, unknown edge or
class, a rollout state that does not allow it) raise ManagerError. Either way nothing is
written.
"""

import math
import time
from collections.abc import Mapping
from dataclasses import dataclass

from fedge.console import alerts, views_store
from fedge.console.deciding import deciding, override_warning
from fedge.console.errors import BadInput
from fedge.console.views import manifest_of
from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.labels import operations as label_operations
from fedge.edge_manager.labels.current import Applied
from fedge.edge_manager.monitor import alert_store
from fedge.edge_manager.rollout.service import Rollouts
from fedge.protocols.errors import ValidationError
from fedge.protocols.thumbnails import ThumbnailPolicy

THRESHOLD_FIELDS = frozenset({"csrf", "threshold", "class_name", "back"})
LABEL_FIELDS = frozenset({"csrf", "prediction_id", "label"})
BACK_TO = frozenset({"fleet", "edge"})  # where a threshold form returns to


@dataclass(frozen=True)
class ThresholdChange:
    edge: str
    threshold: float
    class_name: str | None
    back: str


@dataclass(frozen=True)
class LabelChange:
    prediction_id: str
    label: str


def _only(form: Mapping[str, str], allowed: frozenset[str]) -> None:
    extra = sorted(set(form) - allowed)
    if extra:
        raise BadInput(f"the form sent fields it does not have ({', '.join(extra)}); reload it")


def parse_threshold(edge: str, form: Mapping[str, str]) -> ThresholdChange:
    _only(form, THRESHOLD_FIELDS)
    raw = form.get("threshold", "").strip()
    try:
        value = float(raw)
    except ValueError:
        raise BadInput(f"threshold must be a number in [0, 1], not {raw!r}") from None
    if not math.isfinite(value):
        raise BadInput(f"threshold must be a number in [0, 1], not {raw!r}")
    class_name = form.get("class_name", "").strip() or None
    back = form.get("back", "fleet")
    if back not in BACK_TO:
        raise BadInput(f"the form's return page {back!r} is not one it can send; reload it")
    return ThresholdChange(edge, value, class_name, back)


def parse_label(form: Mapping[str, str]) -> LabelChange:
    _only(form, LABEL_FIELDS)
    prediction_id = form.get("prediction_id", "").strip()
    label = form.get("label", "").strip()
    if not prediction_id or not label:
        raise BadInput("choose a prediction and a label")
    return LabelChange(prediction_id, label)


def set_threshold(fleet: Fleet, change: ThresholdChange) -> str:
    """Push the threshold; returns what was done, for the page and the audit log, with a
    warning when something else keeps deciding (a per-class threshold, or the serving
    model's own recommendation: deciding.py)."""
    pushed = fleet.set_threshold([change.edge], change.threshold, change.class_name)
    scope = f" for {change.class_name}" if change.class_name else ""
    done = []
    for p in pushed:
        text = f"{p.edge}: desired config v{p.version} (threshold {change.threshold:g}{scope})"
        manifest = manifest_of(fleet, views_store.serving_of(fleet.store, p.edge))
        warning = override_warning(
            deciding(fleet.desired_config(p.edge), manifest), change.class_name
        )
        done.append(text + (f". Warning: {warning}" if warning else ""))
    return ", ".join(done)


THUMBNAIL_FIELDS = frozenset({"csrf", "images", "size", "per_minute"})
IMAGES = {"stay": None, "rejects": True, "all": False}  # form value -> rejects_only


@dataclass(frozen=True)
class ThumbnailChange:
    edge: str
    policy: ThumbnailPolicy | None  # None: the station's images stay on it


def parse_thumbnails(edge: str, form: Mapping[str, str]) -> ThumbnailChange:
    _only(form, THUMBNAIL_FIELDS)
    choice = form.get("images", "")
    if choice not in IMAGES:
        raise BadInput(f"images must be one of {', '.join(IMAGES)}, not {choice!r}")
    rejects_only = IMAGES[choice]
    if rejects_only is None:
        return ThumbnailChange(edge, None)
    numbers = {}
    for name in ("size", "per_minute"):
        raw = form.get(name, "").strip()
        if not (raw.isascii() and raw.isdigit()) or len(raw) > 4:  # not '²', not 1e9
            raise BadInput(f"{name.replace('_', ' ')} must be a whole number, not {raw!r}")
        numbers[name] = int(raw)
    try:
        policy = ThumbnailPolicy(numbers["size"], rejects_only, numbers["per_minute"])
    except ValidationError as exc:
        raise BadInput(str(exc)) from None
    return ThumbnailChange(edge, policy)


def set_thumbnails(fleet: Fleet, change: ThumbnailChange) -> str:
    """Share the station's thumbnails, or stop; returns what was done."""
    (pushed,) = fleet.set_thumbnails([change.edge], change.policy)
    policy = change.policy
    if policy is None:
        what = "its images stay on the station"
    else:
        which = "rejected" if policy.rejects_only else "all scored"
        what = f"shares thumbnails of {which} images, {policy.size} px, {policy.per_minute}/min"
    return f"{pushed.edge}: desired config v{pushed.version} ({what})"


def add_label(fleet: Fleet, change: LabelChange, who: str) -> str:
    """Label (or relabel) a prediction; returns what changed, as ``fedge labels add`` says."""
    label_id, outcome = fleet.add_label(change.prediction_id, change.label, who)
    previous = outcome.previous
    if outcome.applied is Applied.UNCHANGED and previous is not None:
        return (
            f"{change.prediction_id} is already labelled {change.label} "
            f"(by {previous.who}); nothing was changed"
        )
    if outcome.applied is Applied.RELABELLED and previous is not None:
        return (
            f"{change.prediction_id} relabelled {previous.label} -> {change.label} "
            f"({label_id}; was labelled by {previous.who})"
        )
    return f"{change.prediction_id} labelled {change.label} ({label_id})"


WITHDRAW_FIELDS = frozenset({"csrf", "prediction_id"})


def withdraw_label(fleet: Fleet, form: Mapping[str, str], who: str) -> str:
    """An operator's undo: the prediction's label given at the manager is withdrawn, here
    and (in the next labels document) at the station; returns what was done."""
    _only(form, WITHDRAW_FIELDS)
    prediction_id = form.get("prediction_id", "").strip()
    if not prediction_id:
        raise BadInput("choose a prediction whose label to withdraw")
    gone = label_operations.withdraw_label(fleet, prediction_id, who)
    return (
        f"{prediction_id}: label {gone.label} withdrawn by {who} (given by {gone.who}); "
        "the station drops it too"
    )


ROLLOUT_FIELDS = frozenset({"csrf", "reason"})
ROLLOUT_OPERATIONS = ("pause", "resume", "abort")
MAX_REASON = 200


def operate_rollout(fleet: Fleet, rollout_id: str, operation: str, form: Mapping[str, str]) -> str:
    """Pause, resume or abort a staged rollout as ``fedge rollout pause|resume|abort`` does
    (``Rollouts``); a state that does not allow it raises RolloutError, changing nothing."""
    _only(form, ROLLOUT_FIELDS)
    if operation not in ROLLOUT_OPERATIONS:
        raise BadInput(f"{operation!r} is not something a rollout can do; reload the page")
    reason = form.get("reason", "").strip() or "by operator"
    if operation != "abort" and form.get("reason"):
        raise BadInput("only an abort takes a reason; reload the page")
    if len(reason) > MAX_REASON:
        raise BadInput(f"the reason is over {MAX_REASON} characters")
    rollouts, now = Rollouts(fleet), time.time()
    if operation == "pause":
        step = rollouts.pause(rollout_id, now)
    elif operation == "resume":
        step = rollouts.resume(rollout_id, now)
    else:
        step = rollouts.abort(rollout_id, now, reason)
    done = f"rollout {rollout_id}: {operation}d, now {step.state.value}"
    if step.roll_back:
        done += f"; rolling back {', '.join(step.roll_back)} to their previous model"
    return done


ALERT_FIELDS = frozenset({"csrf", "note"})
ALERTS_FIELDS = frozenset({"csrf", "note", "operation"})  # and pick-N, one per incident
ALERT_OPERATIONS = ("acknowledge", "clear")
MAX_NOTE = 200
MAX_PICKED = 500


@dataclass(frozen=True)
class AlertChoice:
    operation: str  # acknowledge (they stay open) or clear
    alert_ids: tuple[str, ...]
    note: str


def parse_alerts(form: Mapping[str, str]) -> AlertChoice:
    """The alerts page's form: the incidents ticked (``pick-N``: their alert ids, comma
    separated), what to do and the note."""
    _only(form, ALERTS_FIELDS | {k for k in form if k.startswith("pick-")})
    operation = form.get("operation", "")
    if operation not in ALERT_OPERATIONS:
        raise BadInput(f"{operation!r} is not something an alert can be; reload the page")
    ids: list[str] = []
    for key, value in form.items():
        if key.startswith("pick-"):
            ids += [part.strip() for part in value.split(",") if part.strip()]
    if not ids:
        raise BadInput(f"tick the incidents to {operation} first")
    if len(ids) > MAX_PICKED:
        raise BadInput(f"at most {MAX_PICKED} alerts at once")
    return AlertChoice(operation, tuple(dict.fromkeys(ids)), form.get("note", "").strip())


def act_on_alerts(fleet: Fleet, choice: AlertChoice, who: str) -> str:
    """Acknowledge (the alerts stay open, the acknowledgement kept with them) or clear
    (as ``fedge alerts clear``) open alerts, with a required note; returns what was done,
    note included, for the page and the audit log. Every alert is checked (known, open)
    before anything is written: an unknown or cleared one changes nothing."""
    views = [alert_store.get_alert(fleet.store, alert_id) for alert_id in choice.alert_ids]
    closed = [v.alert_id for v in views if not v.is_open]
    if closed:
        raise ManagerError(
            f"alert {', '.join(closed)} was already cleared; nothing was changed "
            "(reload the page to see what is open)"
        )
    if not choice.note:
        raise BadInput(
            f"a note is required to {choice.operation} an alert: say what you found or did"
        )
    if len(choice.note) > MAX_NOTE:
        raise BadInput(f"the note is over {MAX_NOTE} characters")
    if choice.operation == "acknowledge":
        alerts.acknowledge(fleet, list(choice.alert_ids), choice.note, who)
        verb = "acknowledged (still open)"
    else:
        for view in views:
            alert_store.acknowledge(fleet.store, view.alert_id, who, choice.note, time.time())
        verb = "cleared"
    what = "; ".join(f"{v.alert_id} ({v.kind} on {v.edge}, {v.model})" for v in views)
    return f"{verb} by {who}: {what}; note: {choice.note}"


def acknowledge_alert(fleet: Fleet, alert_id: str, form: Mapping[str, str], who: str) -> str:
    """Clear one open alert as ``fedge alerts clear`` does (``alert_store``): it is not
    raised again for that edge and model until its condition stopped holding once. A
    note is required; an unknown or already cleared alert raises ManagerError."""
    _only(form, ALERT_FIELDS)
    return act_on_alerts(
        fleet, AlertChoice("clear", (alert_id,), form.get("note", "").strip()), who
    )

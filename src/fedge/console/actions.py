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

from fedge.console import views_store
from fedge.console.deciding import deciding, override_warning
from fedge.console.errors import BadInput
from fedge.console.views import manifest_of
from fedge.edge_manager.fleet.operations import Fleet
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
MAX_NOTE = 200


def acknowledge_alert(fleet: Fleet, alert_id: str, form: Mapping[str, str], who: str) -> str:
    """Acknowledge an open alert as ``fedge alerts clear`` does (``alert_store``): it is
    cleared and not raised again for that edge and model until its condition stopped
    holding once. An unknown or already cleared alert raises ManagerError."""
    _only(form, ALERT_FIELDS)
    note = form.get("note", "").strip()
    if len(note) > MAX_NOTE:
        raise BadInput(f"the note is over {MAX_NOTE} characters")
    view = alert_store.acknowledge(fleet.store, alert_id, who, note, time.time())
    return f"cleared {view.alert_id} ({view.kind} on {view.edge}, {view.model}) by {who}"

"""Pure decisions about desired documents: the next config, the next deployment."""

import dataclasses
from typing import TypedDict

from fedge.protocols.config import EdgeConfig, PrivacyBudget, TrainingPolicy
from fedge.protocols.deployment import DeploymentDesired
from fedge.protocols.freshness import expiry
from fedge.protocols.thumbnails import ThumbnailPolicy


class ConfigChange(TypedDict, total=False):
    """One change to a station's config, as :func:`next_config` takes it."""

    threshold: float | None
    class_name: str | None
    training: TrainingPolicy | None
    clear_class: str | None
    model: str | None
    privacy: PrivacyBudget | None
    clear_privacy: bool
    thumbnails: ThumbnailPolicy | None
    clear_thumbnails: bool
    viewing: bool | None
    anomaly_threshold: float | None
    anomaly_threshold_model: str | None
    clear_anomaly: bool


def next_config(
    current: EdgeConfig | None,
    *,
    fleet: str,
    edge: str,
    now: float,
    threshold: float | None = None,
    class_name: str | None = None,
    training: TrainingPolicy | None = None,
    clear_class: str | None = None,
    model: str | None = None,
    privacy: PrivacyBudget | None = None,
    clear_privacy: bool = False,
    thumbnails: ThumbnailPolicy | None = None,
    clear_thumbnails: bool = False,
    viewing: bool | None = None,
    anomaly_threshold: float | None = None,
    anomaly_threshold_model: str | None = None,
    clear_anomaly: bool = False,
) -> EdgeConfig:
    """A full new document: the current one with one change and the version bumped.

    ``class_name`` sets that class's threshold; without it the default threshold changes.
    ``training`` replaces the station's training policy (None keeps the current one).
    ``clear_class`` removes that class's threshold: the default applies to it again.
    ``model`` ties the thresholds to that model version (None keeps the current tie).
    ``privacy`` sets the station's lifetime privacy budget (None keeps the current one);
    ``clear_privacy`` removes it (no lifetime bound; each job's own target still holds).
    ``thumbnails`` makes the station share thumbnails of what it scores (None keeps the
    current choice); ``clear_thumbnails`` stops it: its images stay on the station.
    ``viewing`` True lets operators view the station's images on demand, False stops it
    (None keeps the current choice; off is sent as the field left out).
    ``anomaly_threshold`` sets the score over which the station's anomaly model calls a
    part novel (None keeps the current one), for ``anomaly_threshold_model`` (the
    anomaly model deployed beside the classifier; None: whichever it serves);
    ``clear_anomaly`` removes both.
    """
    base = current or EdgeConfig(fleet=fleet, edge=edge, version=1)
    version = base.version + 1 if current is not None else 1
    class_thresholds = dict(base.class_thresholds)
    default = base.default_threshold
    if threshold is not None:
        if class_name is None:
            default = threshold
        else:
            class_thresholds[class_name] = threshold
    if clear_class is not None:
        class_thresholds.pop(clear_class, None)
    return dataclasses.replace(
        base,
        version=version,
        default_threshold=default,
        class_thresholds=class_thresholds,
        issued_at=now,
        # Signed with its expiry from the start: a document without one could be
        # replayed forever, and gRPC serves a station what is written at once, before
        # the serve loop's next pass (freshness.py).
        expires_at=expiry(now),
        training=base.training if training is None else training,
        model=base.model if model is None else model,
        privacy=None if clear_privacy else (base.privacy if privacy is None else privacy),
        thumbnails=None
        if clear_thumbnails
        else (base.thumbnails if thumbnails is None else thumbnails),
        operator_viewing=base.operator_viewing if viewing is None else (True if viewing else None),
        anomaly_threshold=None
        if clear_anomaly
        else (base.anomaly_threshold if anomaly_threshold is None else anomaly_threshold),
        anomaly_threshold_model=None
        if clear_anomaly
        else (
            base.anomaly_threshold_model if anomaly_threshold is None else anomaly_threshold_model
        ),
    )


def next_deployment(
    current_version: int | None,
    *,
    fleet: str,
    edge: str,
    deployment_id: str,
    manifest_envelope: str,
    grpc_target: str,
    now: float,
    anomaly_envelope: str | None = None,
) -> DeploymentDesired:
    return DeploymentDesired(
        fleet=fleet,
        edge=edge,
        version=(current_version or 0) + 1,
        deployment_id=deployment_id,
        manifest_envelope=manifest_envelope,
        grpc_target=grpc_target,
        issued_at=now,
        anomaly_envelope=anomaly_envelope,
    )

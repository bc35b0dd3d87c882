"""Whether a published model can serve as the anomaly model beside a classifier (pure).

Issue 28: a deployment or a staged rollout may carry an anomaly model beside the
classifier. The station checks the pair when it stages it (``runtime.check_anomaly``);
the manager checks the same from the two signed manifests first, so a wrong reference
-- a classifier named as the anomaly model, one fitted on other images -- is refused
with nothing written, not found out at every station one failed deployment at a time.

An anomaly model gives one score per image: its first output has rank 1 (``[batch]``,
then its ``anomaly_map``), where a classifier's has rank 2 (``[batch, classes]``). It
must take the classifier's images as they are (one decode and one prepared batch serve
both): the same input shape past the batch axis, and no other preprocessing.
"""

from fedge.protocols.manifest import ModelManifest


def anomaly_problem(
    classifier: ModelManifest, anomaly: ModelManifest, *, images: bool = True
) -> str | None:
    """Why ``anomaly`` cannot serve beside ``classifier`` (None: it can); ``images``:
    whether it must also take the classifier's images (else only its kind is checked)."""
    if anomaly.ref == classifier.ref:
        return f"{anomaly.ref} is the classifier itself, not an anomaly model"
    scores = anomaly.outputs[0]
    if len(scores.shape) != 1:
        return (
            f"{anomaly.ref} is not an anomaly model: its first output {scores.name!r} has "
            f"shape {list(scores.shape)}, an anomaly model gives one score per image ([batch]); "
            'publish the anomaly fleet job\'s model (family = "anomaly")'
        )
    if not images:
        return None
    theirs, ours = anomaly.inputs[0], classifier.inputs[0]
    if theirs.shape[1:] != ours.shape[1:] or anomaly.preprocess not in (
        None,
        classifier.preprocess,
    ):
        return (
            f"anomaly model {anomaly.ref} takes {list(theirs.shape)} images prepared as "
            f"{anomaly.preprocess}, but {classifier.ref} takes {list(ours.shape)} prepared as "
            f"{classifier.preprocess}; fit it on the classifier's own backbone"
        )
    return None

"""The ``anomaly`` model family: what good parts look like, fitted from sums (PaDiM).

PaDiM (Defard et al., ICPR 2021): features of a CNN at every location of a grid, one
multivariate Gaussian per location fitted on good parts only, an anomaly map of
Mahalanobis distances and the image's score its largest value. The fit needs only the
count, the sum and the sum of outer products of the features per location, so
statistics computed at each station add up to exactly the fit on the pooled images.

- :mod:`~fedge.models.anomaly.backbone`: the feature extractor (the fleet's inspection
  CNN's feature layers, or a user's TorchScript file).
- :mod:`~fedge.models.anomaly.statistics`: sufficient statistics, their sum, the fit.
- :mod:`~fedge.models.anomaly.private`: the DP release of a station's statistics.
- :mod:`~fedge.models.anomaly.threshold`: a station's threshold for a false-alarm rate.
- :mod:`~fedge.models.anomaly.model`: the scoring network and its export to ONNX.

Errors (all :class:`AnomalyError`, a :class:`~fedge.models.errors.ModelsError`)::

    AnomalyError
    +-- BackboneError      the backbone file does not load or does not fit the images
    +-- StatisticsError    no good parts, statistics that do not match, a bad threshold
"""

from fedge.models.errors import ModelsError


class AnomalyError(ModelsError):
    """The anomaly model cannot be built, fitted or exported; the message says why."""


class BackboneError(AnomalyError):
    """A backbone does not load, or its output does not fit the image size."""


class StatisticsError(AnomalyError):
    """Statistics that cannot be computed, added or fitted (no parts, other shapes)."""

"""The telemetry pace document (issue 33): bounded, and refused when it is not."""

import math

import pytest

from fedge.protocols import codec
from fedge.protocols.errors import ValidationError
from fedge.protocols.pace import MAX_FACTOR, TelemetryPace


def test_a_pace_document_round_trips() -> None:
    document = TelemetryPace("plant-a", "st-01", 3, 6.0, "short of space", 12.5)
    assert codec.decode(codec.encode(document), TelemetryPace) == document
    assert document.slowed
    assert not TelemetryPace("plant-a", "st-01", 4, 1.0).slowed


@pytest.mark.parametrize("factor", [0.5, 0.0, -1.0, MAX_FACTOR + 1, math.nan, math.inf])
def test_a_factor_outside_one_to_the_limit_is_refused(factor: float) -> None:
    # Faster than normal would let a document flood the manager; slower than the limit
    # would silence a station's counters for too long.
    with pytest.raises(ValidationError):
        TelemetryPace("plant-a", "st-01", 1, factor)


def test_a_bad_identity_version_or_reason_is_refused() -> None:
    with pytest.raises(ValidationError):
        TelemetryPace("plant-a", "../st", 1, 2.0)
    with pytest.raises(ValidationError):
        TelemetryPace("plant-a", "st-01", 0, 2.0)
    with pytest.raises(ValidationError):
        TelemetryPace("plant-a", "st-01", 1, 2.0, "x" * 513)

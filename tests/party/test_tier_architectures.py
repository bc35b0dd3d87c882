"""A station trains the architecture its tier is told, and refuses one its family lacks;
the server distils a family's sizes with the simulator's FedDF code (issue 32, item 7)."""

import numpy as np
import pytest
from flwr.app import ArrayRecord, ConfigRecord

from fedge.aggregator.strategies import ensemble
from fedge.datasets.defects import CLASSES
from fedge.models import digits
from fedge.party import families
from fedge.party.errors import FamilyError, PartyError
from fedge.party.station_app import Station, train_round
from fedge.protocols.manifest import Preprocess
from fedge.protocols.model_spec import ModelSpec

SPEC = ModelSpec("inspection-cnn", {"width": 16, "image_size": 32}, CLASSES, Preprocess(32))


def test_the_round_names_the_size_the_station_builds() -> None:
    assert families.round_spec(SPEC, None) is SPEC
    small = families.round_spec(SPEC, "cnn-small")
    assert small.params == {"width": 4, "image_size": 32}
    assert small.family == SPEC.family and small.classes == SPEC.classes
    with pytest.raises(FamilyError, match=r"no architecture 'cnn-huge'.*cnn, cnn-large, cnn-small"):
        families.round_spec(SPEC, "cnn-huge")
    with pytest.raises(FamilyError, match="must name an architecture"):
        families.round_spec(SPEC, 7)


def test_a_station_refuses_an_unknown_architecture_before_training(tmp_path) -> None:  # type: ignore[no-untyped-def]
    station = Station("st-01", tmp_path, 20, 1, 5.0)
    config = ConfigRecord({"arch": "cnn-huge", "server-round": 1})
    with pytest.raises(PartyError, match="no architecture 'cnn-huge'"):
        train_round(station, SPEC, ArrayRecord(), config)


def test_the_server_distils_every_size_of_a_family() -> None:
    catalogue = families.architectures(SPEC)
    assert catalogue.sample_shape == (1, 32, 32)
    assert catalogue.parameters("cnn-small") * 4 < catalogue.parameters("cnn-large")
    models = {
        a: digits.to_arrays(catalogue.build(a, i)) for i, a in enumerate(("cnn-large", "cnn-small"))
    }
    proxy = np.random.default_rng(0).random((8, 1, 32, 32), dtype=np.float32)
    settings = ensemble.DistillSettings(epochs=1, batch_size=4)
    out, losses = ensemble.distill_into_each(
        models, ensemble.validate_proxy(proxy, catalogue.sample_shape), settings,
        architectures=catalogue,
    )  # fmt: skip
    assert set(out) == {"cnn-large", "cnn-small"}
    assert all(np.isfinite(before) and np.isfinite(after) for before, after in losses.values())
    small = catalogue.build("cnn-small", 0)
    digits.load_arrays(small, out["cnn-small"])  # the distilled weights fit their size

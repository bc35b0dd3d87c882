"""The predictions that reached the manager, as an operator looks them up.

``fedge predictions list`` finds the ids to label (``fedge labels add``), so the filters
are the questions an operator asks: which station, which model version, which decision,
still unlabelled. Reading only: the statements, and the dataclasses the rows become,
are :mod:`fedge.edge_manager.fleet.prediction_store`'s.
"""

import time
from dataclasses import dataclass

from fedge.edge_manager.errors import ManagerError
from fedge.edge_manager.fleet import prediction_store
from fedge.edge_manager.fleet.prediction_store import LabelView as LabelView
from fedge.edge_manager.fleet.prediction_store import PredictionView as PredictionView
from fedge.edge_manager.store import Store

DECISIONS = ("accept", "reject")


@dataclass(frozen=True)
class PredictionFilter:
    """What ``list_predictions`` selects; ``None`` means any. Newest first, ``limit`` rows."""

    edge: str | None = None
    model: str | None = None  # a registry reference, NAME:VERSION
    decision: str | None = None
    unlabelled: bool = False
    limit: int = 20

    def __post_init__(self) -> None:
        if self.decision is not None and self.decision not in DECISIONS:
            raise ManagerError(
                f"decision must be one of {', '.join(DECISIONS)}, not {self.decision!r}"
            )
        if self.model is not None and not _is_ref(self.model):
            raise ManagerError(f"model must be NAME:VERSION, e.g. inspect:1, not {self.model!r}")
        if self.limit < 1:
            raise ManagerError(f"limit must be >= 1, not {self.limit}")


def _is_ref(value: str) -> bool:
    name, sep, version = value.rpartition(":")
    return bool(sep and name and version.isdigit())


def list_predictions(store: Store, selected: PredictionFilter) -> list[PredictionView]:
    """The newest predictions matching ``selected``, with their labels."""
    return prediction_store.find(
        store,
        edge=selected.edge,
        model=selected.model,
        decision=selected.decision,
        unlabelled=selected.unlabelled,
        limit=selected.limit,
    )


def get_prediction(store: Store, prediction_id: str) -> PredictionView:
    found = prediction_store.get(store, prediction_id)
    if found is None:
        raise ManagerError(
            f"no prediction {prediction_id!r} has reached the manager; see `fedge predictions list`"
        )
    return found


def wait_for_predictions(
    store: Store, selected: PredictionFilter, timeout_s: float, poll_s: float = 0.2
) -> list[PredictionView]:
    """``list_predictions``, polled until it finds any or ``timeout_s`` has passed.

    A station reports its predictions a moment after it scores them (its report
    interval), so a script that has just dropped images asks with a timeout instead of
    sleeping a guessed time.
    """
    deadline = time.monotonic() + timeout_s
    while True:
        found = list_predictions(store, selected)
        if found or time.monotonic() >= deadline:
            return found
        time.sleep(poll_s)

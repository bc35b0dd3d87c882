"""What a fleet job trains: the contract between the aggregator and every station.

The round config carries it as JSON (``model-spec``): the model family and its size, the
classes in output order, and how an image becomes the model's input. No torch, no Flower.
"""

from __future__ import annotations

import json
from dataclasses import dataclass

from fedge.protocols.errors import ValidationError
from fedge.protocols.manifest import Preprocess

MODEL_SPEC_KEY = "model-spec"


@dataclass(frozen=True)
class ModelSpec:
    """What the job trains: a family and size, its classes, how images are prepared."""

    family: str
    params: dict[str, int]
    classes: tuple[str, ...]
    preprocess: Preprocess

    @classmethod
    def from_json(cls, text: object) -> ModelSpec:
        if not isinstance(text, str):
            raise ValidationError(
                f"config[{MODEL_SPEC_KEY!r}] is missing: this is no fedge fleet job"
            )
        try:
            data = json.loads(text)
            return cls(
                family=str(data["family"]),
                params={str(k): int(v) for k, v in data["params"].items()},
                classes=tuple(str(c) for c in data["classes"]),
                preprocess=Preprocess(**data["preprocess"]),
            )
        except (ValueError, KeyError, TypeError, AttributeError) as exc:
            raise ValidationError(f"config[{MODEL_SPEC_KEY!r}] is not a model spec: {exc}") from exc

    def to_json(self) -> str:
        return json.dumps(
            {
                "family": self.family,
                "params": self.params,
                "classes": list(self.classes),
                "preprocess": vars(self.preprocess),
            },
            sort_keys=True,
        )

"""Honest thresholds (issue 30, item 2): the threshold shown is the one the agent's own
``thresholds_in_force`` picks, and a value that would decide nothing is warned about."""

from fedge.console.deciding import deciding, override_warning
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import ModelManifest, TensorSpec, Thresholds


def manifest(version: int = 1, thresholds: Thresholds | None = None) -> ModelManifest:
    return ModelManifest(
        name="inspect",
        version=version,
        sha256="0" * 64,
        size=10,
        inputs=(TensorSpec("x", "float32", (1, 4)),),
        outputs=(TensorSpec("y", "float32", (1, 2)),),
        classes=("clean", "scratch"),
        positive_classes=("scratch",),
        thresholds=thresholds,
    )


def config(default: float, per_class: dict[str, float], model: str | None = None) -> EdgeConfig:
    return EdgeConfig("plant-a", "st-02", 4, default, per_class, model=model)


def test_a_per_class_threshold_decides_and_the_default_is_warned_about() -> None:
    # The case: st-02 set to 0.6 kept scratch at 0.181262.
    now = deciding(config(0.6, {"scratch": 0.181262}, "inspect:1"), manifest())
    assert now.threshold_for("scratch") == 0.181262
    assert now.text() == ("scratch 0.181262 (per-class); default 0.6 decides no defect class")
    warning = override_warning(now, None)
    assert warning is not None and "scratch 0.181262" in warning
    assert override_warning(now, "scratch") is None  # setting the class's own decides
    assert "not a defect class" in str(override_warning(now, "clean"))


def test_the_default_alone_decides_when_no_class_has_its_own() -> None:
    now = deciding(config(0.72, {}), manifest())
    assert now.text() == "0.72" and override_warning(now, None) is None


def test_the_serving_models_recommendation_overrides_a_config_for_another_model() -> None:
    recommended = Thresholds(0.3, {"scratch": 0.25})
    now = deciding(config(0.9, {}, "inspect:1"), manifest(2, recommended))
    assert now.threshold_for("scratch") == 0.25
    assert now.text().endswith("(the model's recommendation)")
    assert "recommended thresholds decide" in str(override_warning(now, None))


def test_no_config_yet_is_the_agents_default_or_the_models() -> None:
    assert deciding(None, None).text() == "0.5 (default)"
    assert deciding(None, manifest(1, Thresholds(0.4))).text() == "0.4 (the model's recommendation)"

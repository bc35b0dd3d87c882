"""Which threshold decides each defect class on a station, and what a new one would change
(issue 30, item 2).

The station decides with :func:`fedge.edge_agent.config.decisions.thresholds_in_force`:
the config in force, unless it was set for another model and the serving model's signed
manifest recommends thresholds of its own. Within those, a class with its own threshold
ignores the default. The console calls the agent's own pure function, so the threshold
it shows is the one the station applies (checked against the agent's ``/v1/status`` in
tests/console/test_honest_console.py), and it warns when the value an operator is about
to set would decide nothing.
"""

from dataclasses import dataclass

from fedge.edge_agent.config.decisions import ThresholdSource, thresholds_in_force
from fedge.protocols.config import EdgeConfig
from fedge.protocols.manifest import ModelManifest

SOURCE_WORDS = {
    ThresholdSource.CONFIG: "",
    ThresholdSource.MODEL: "the model's recommendation",
    ThresholdSource.UNTIED: "set for another model",
    ThresholdSource.DEFAULT: "default",  # the agent's own, before any config
}


@dataclass(frozen=True)
class Deciding:
    """The thresholds a station decides with now."""

    default_threshold: float
    per_class: dict[str, float]  # every class with its own threshold
    positives: tuple[str, ...]  # the defect classes whose scores decide
    source: ThresholdSource
    model: str  # the serving model ('' : none)

    def threshold_for(self, class_name: str) -> float:
        return self.per_class.get(class_name, self.default_threshold)

    def overridden(self) -> dict[str, float]:
        """The defect classes that decide with their own threshold, not the default."""
        return {c: self.per_class[c] for c in self.positives if c in self.per_class}

    def text(self) -> str:
        """The table's cell: the default alone when it decides every defect class, else
        each defect class's deciding threshold; where it comes from when not the config."""
        own = self.overridden()
        if not own:
            shown = f"{self.default_threshold:g}"
        else:
            parts = [
                f"{c} {t:g} (per-class)" if c in own else f"{c} {t:g}"
                for c, t in ((c, self.threshold_for(c)) for c in self.positives)
            ]
            shown = "; ".join(parts)
            if len(own) == len(self.positives):
                shown += f"; default {self.default_threshold:g} decides no defect class"
        words = SOURCE_WORDS[self.source]
        return shown + (f" ({words})" if words else "")


def positives_of(manifest: ModelManifest | None) -> tuple[str, ...]:
    """The classes whose scores decide, as the agent's ``decide`` takes them."""
    if manifest is None:
        return ()
    return manifest.positive_classes or tuple(manifest.classes[1:])


def deciding(config: EdgeConfig | None, manifest: ModelManifest | None) -> Deciding:
    """The thresholds ``config`` (the one in force; None: none yet) gives the station
    serving ``manifest`` (None: no model, or one this registry does not hold)."""
    in_force = thresholds_in_force(config, manifest)
    return Deciding(
        in_force.default_threshold,
        dict(in_force.class_thresholds),
        positives_of(manifest),
        in_force.source,
        in_force.model,
    )


def override_warning(now: Deciding, class_name: str | None) -> str | None:
    """What an operator setting the default (``class_name`` None) or ``class_name``'s
    threshold should know: a per-class threshold, or the model's recommendation, that
    would keep deciding instead. None: the value set is the one that decides."""
    if now.source is ThresholdSource.MODEL:
        return (
            f"{now.model}'s own recommended thresholds decide on this station (the config's "
            "thresholds were set for another model); the value set here applies only when "
            "it serves that model"
        )
    if class_name is not None:
        if now.positives and class_name not in now.positives:
            return (
                f"{class_name} is not a defect class of {now.model or 'the serving model'} "
                f"(those are {', '.join(now.positives)}): its threshold decides nothing"
            )
        return None
    own = now.overridden()
    if not own:
        return None
    listed = ", ".join(f"{c} {t:g}" for c, t in sorted(own.items()))
    scope = "every defect class" if len(own) == len(now.positives) else "those classes"
    return (
        f"per-class thresholds stay in force for {listed}: the default does not decide "
        f"{scope}; set or clear the class's own threshold on the edge page"
    )

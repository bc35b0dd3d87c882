"""The edge page's score histograms: the defect score of an edge's recent predictions,
per model version, with the threshold that decided them.

The defect score of a prediction is its highest score among the model's positive
(defect) classes, the score the agent compares with the threshold. One histogram per
model version, because a new version moves the whole distribution: a threshold tuned
for one is wrong for the next, and this is where an operator sees it. Drawn as inline
SVG (no script, nothing from elsewhere).
"""

import html
import json
from collections import defaultdict
from dataclasses import dataclass

from fedge.console import views_store
from fedge.edge_manager.fleet.operations import Fleet

BINS = 20
RECENT = 2000


@dataclass(frozen=True)
class Histogram:
    model: str
    counts: tuple[int, ...]  # BINS bins over [0, 1]
    rejects: tuple[int, ...]  # of those, decided reject
    threshold: float | None  # the newest prediction's threshold (None: mixed is not shown)
    n: int

    def svg(self, width: int = 420, height: int = 140) -> str:
        pad, top = 24, max(self.counts) or 1
        bar = (width - 2 * pad) / BINS
        parts = [
            f'<svg class="chart histogram" viewBox="0 0 {width} {height}" width="{width}" '
            f'height="{height}" role="img" aria-label="defect scores of {html.escape(self.model)}">'
        ]
        for index, (count, rejected) in enumerate(zip(self.counts, self.rejects, strict=True)):
            x = pad + index * bar
            # One title per bin, on the group: a title in each of its two bars was read
            # (and shown on hover) twice (issue 30).
            parts.append(
                f"<g><title>{index / BINS:.2f}-{(index + 1) / BINS:.2f}: {count} "
                f"({rejected} rejected)</title>"
            )
            for value, css in ((count, "all"), (rejected, "reject")):
                h = (height - 2 * pad) * value / top
                parts.append(
                    f'<rect x="{x:.1f}" y="{height - pad - h:.1f}" width="{bar - 1:.1f}" '
                    f'height="{h:.1f}" class="{css}"/>'
                )
            parts.append("</g>")
        if self.threshold is not None:
            x = pad + (width - 2 * pad) * self.threshold
            parts.append(
                f'<line x1="{x:.1f}" y1="{pad / 2}" x2="{x:.1f}" y2="{height - pad}" '
                f'class="threshold"/><text x="{x + 3:.1f}" y="{pad - 4}">threshold '
                f"{self.threshold:g}</text>"
            )
        parts.append(
            f'<text x="{pad}" y="{height - 6}">0</text>'
            f'<text x="{width - pad}" y="{height - 6}" text-anchor="end">1 (defect score)</text>'
            "</svg>"
        )
        return "".join(parts)


def score_histograms(fleet: Fleet, edge: str, limit: int = RECENT) -> list[Histogram]:
    """``edge``'s newest ``limit`` predictions, one histogram per model version (newest
    version first); a model the registry does not know (no positive classes) is left out."""
    positives = views_store.positive_classes(fleet.store)
    counts: dict[str, list[int]] = defaultdict(lambda: [0] * BINS)
    rejects: dict[str, list[int]] = defaultdict(lambda: [0] * BINS)
    thresholds: dict[str, float] = {}
    newest: dict[str, float] = {}
    for row in views_store.recent_scores(fleet.store, edge, limit):
        model = row.model
        classes = positives.get(model)
        if not classes:
            continue
        try:
            scores = json.loads(row.scores)
            score = max(float(scores[c]) for c in classes if c in scores)
        except (ValueError, TypeError):  # no positive class in its scores, or not JSON
            continue
        index = min(BINS - 1, max(0, int(score * BINS)))
        counts[model][index] += 1
        rejects[model][index] += row.decision == "reject"
        thresholds.setdefault(model, row.threshold)  # rows come newest first
        newest.setdefault(model, row.at)
    return [
        Histogram(
            model,
            tuple(counts[model]),
            tuple(rejects[model]),
            thresholds.get(model),
            sum(counts[model]),
        )
        for model in sorted(counts, key=lambda m: newest[m], reverse=True)
    ]


def deploy_history(fleet: Fleet, edge: str, limit: int = 20) -> list[dict[str, object]]:
    """``edge``'s newest deployment events (stage, reason, what it served), newest first."""
    return views_store.deploy_events(fleet.store, edge, limit)

"""The demo's anomaly chapter (issue 28): what normal looks like, learned from good parts.

The stations have scored and their operators labelled tens of parts by now. An anomaly
fleet job (``[task] family = "anomaly"``) fits PaDiM's per-location Gaussian of backbone
features (Defard et al., ICPR 2020) on the parts operators labelled good: each station
sends count, sum and sum of outer products, the aggregator adds them, so the fit equals
the fit on the pooled parts without an image leaving a station. The model is deployed
beside the serving classifier, and each station gets the anomaly threshold it measured
on its own held-out good parts (``fedge edge set-threshold all --anomaly recommended``).

Then dents appear at two stations, a defect shape the classifier never saw: it calls
most of them clean. A clean part over its station's anomaly threshold is *novel*; the
label queue (``fedge labels queue``, run as the operator runs it) puts novel parts first,
and the operator labels them. The classifier's class set is ``clean``/``scratch`` and
stays so: a new class needs a new output layer, its threshold and its gate, more than the
demo's minutes allow; the operator labels a dent with the defect class (``scratch``,
which rejects the part), and the next fleet job (the next chapter) trains on those
labels and learns to reject dents.

:func:`plot_data` and the checks (:func:`fedge.demo.checks.story_checks`) are pure.
"""

from __future__ import annotations

import dataclasses
import io
import json
import subprocess
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import numpy as np
from PIL import Image
from rich.console import Console
from rich.table import Table

from fedge.aggregator.anomaly.rounds import fleet_fit, read_thresholds
from fedge.aggregator.jobs.checkpoint import load_arrays
from fedge.aggregator.jobs.run_store import RunStore
from fedge.datasets.defects import CLASSES, make_defect_images
from fedge.demo.learning import DENT_STATIONS, config_applied, enable_training, post_json
from fedge.edge_manager.fleet.operations import Fleet
from fedge.edge_manager.home.layout import ManagerHome
from fedge.edge_manager.reports import store as report_store
from fedge.edge_manager.store import Store
from fedge.federation import fleet_job
from fedge.federation.prepare import prepare
from fedge.federation.publish import publish
from fedge.models.anomaly.threshold import min_parts_for
from fedge.protocols.records import is_novel
from fedge.sim.processes import fedge_executable

SCORE_IMAGES = 32  # per station, after the anomaly model is deployed
DEFECT_FRACTION = 0.5  # of those: defects (dents at the dent stations, scratches elsewhere)
SCORE_SEED = 500  # + the station's index; distinct from every other set of the demo
FALSE_ALARM_RATE = 0.05  # each station's threshold: this rate on its good parts out of sample
QUEUE_LIMIT = 25  # one page of `fedge labels queue`
MAX_PAGES = 10  # the chapter scores ~100 parts: never more novel ones than this many pages
OPERATOR = "demo-operator"
JOB = """# Written by the demo: one round of sufficient statistics of the stations' good parts.
[job]
name = "normal-parts"
rounds = 1
seed = 0

[task]
model = "{model}"        # its feature layers are the backbone
family = "anomaly"

[anomaly]
false_alarm_rate = {rate}

[federation]
backend = "fleet"
fleet = "{fleet}"
edges = "all"
node_wait_s = 300.0
round_timeout_s = 300.0
eval_timeout_s = 300.0
"""

# What a scored part really is (the generator's ground truth).
GOOD, DENT, SCRATCH = "good", "dent", "scratch"


@dataclass(frozen=True)
class ScoredPart:
    """One part scored through a station's local API, as its record says."""

    edge: str
    prediction_id: str
    truth: str  # GOOD, DENT or SCRATCH
    decision: str  # the classifier's: "accept" (clean) or "reject"
    anomaly_score: float | None
    threshold: float | None  # the station's anomaly threshold in force
    novel: bool


@dataclass(frozen=True)
class StationPlot:
    """One station's anomaly scores by what the part was and what was decided."""

    threshold: float | None
    good: list[float]
    novel_dents: list[float]  # the classifier passed them; over the threshold
    missed_dents: list[float]  # the classifier passed them; under the threshold
    rejected_dents: list[float]  # the classifier rejected them itself
    scratches: list[float]


@dataclass
class AnomalyChapter:
    """What the chapter measured, for the report and the checks."""

    job_dir: Path
    published: str = ""
    classifier: str = ""
    job_s: float = 0.0
    counted: dict[str, int] = field(default_factory=dict)  # good parts in the fit, per station
    # Per station: the good parts its threshold rests on, held out and left out of the fit
    # (what it reported: `calibration_examples`, `holdout_examples`).
    calibration: dict[str, tuple[int, int]] = field(default_factory=dict)
    fit_count: int = 0  # good parts the published model says it was fitted on
    thresholds: dict[str, float] = field(default_factory=dict)  # pushed, per station
    parts: list[ScoredPart] = field(default_factory=list)
    # `fedge labels queue --json` items (prediction_id, novel) before and after labelling
    queue: list[dict[str, Any]] = field(default_factory=list)
    queue_after: list[dict[str, Any]] = field(default_factory=list)
    labelled: dict[str, str] = field(default_factory=dict)  # prediction_id -> label given


def run_anomaly(
    out: Path,
    home: ManagerHome,
    fleet: Fleet,
    store: Store,
    ports: dict[str, int],
    console: Console,
    wait: Any,
) -> AnomalyChapter:
    """The chapter; ``wait(predicate, timeout_s, what)`` is the demo's poller."""
    edges = sorted(ports)
    result = AnomalyChapter(out / "anomaly-job")
    console.rule("[bold]what normal looks like: an anomaly model from the stations' good parts")
    enable_training(fleet, store, edges, wait)
    _fit(out, home, fleet, result, console)
    _deploy_beside(fleet, store, edges, result, console, wait)

    console.print(
        f"{', '.join(DENT_STATIONS)} now see dents ({DEFECT_FRACTION:.0%} of "
        f"{SCORE_IMAGES} parts each), a defect shape the classifier never saw"
    )
    before = report_store.prediction_count(store)
    for index, edge in enumerate(edges):
        result.parts += score_parts(ports[edge], edge, seed=SCORE_SEED + index)
    wait(
        lambda: report_store.prediction_count(store) - before >= len(result.parts),
        60,
        "the chapter's predictions at the manager",
    )
    _print_parts(result, console)

    # The operator works down the queue a page at a time, until no novel part is left.
    result.queue = page = labels_queue(home)
    console.print(
        f"fedge labels queue: {sum(1 for i in page if i.get('novel'))} novel part(s) first "
        f"on its first page of {len(page)}",
        highlight=False,
    )
    for _ in range(MAX_PAGES):
        novel = [item for item in page if item.get("novel")]
        if not novel:
            break
        _label_novel(home, fleet, result, novel)
        page = labels_queue(home)
    result.queue_after = page
    dents = sum(1 for label in result.labelled.values() if label != CLASSES[0])
    console.print(
        f"the operator labelled the {len(result.labelled)} novel part(s): {dents} as "
        f"{CLASSES[1]} (dents), {len(result.labelled) - dents} as {CLASSES[0]}; the labels "
        "travel to the stations that scored them, for the next fleet job",
        highlight=False,
    )
    return result


def _fit(
    out: Path, home: ManagerHome, fleet: Fleet, result: AnomalyChapter, console: Console
) -> None:
    """The anomaly fleet job: one round of sums over the stations' good parts."""
    manifest = out / "anomaly-job.toml"
    manifest.write_text(
        JOB.format(model="inspect:1", rate=FALSE_ALARM_RATE, fleet=fleet.fleet), encoding="utf-8"
    )
    started = time.monotonic()
    prepare(manifest, result.job_dir, home)
    fleet_job.submit_to_fleet(result.job_dir, home)
    with console.status("anomaly fleet job on the SuperLink (one round of sums)…"):
        ended = fleet_job.wait(result.job_dir, timeout_s=900)
    if ended.state.value != "completed":
        raise RuntimeError(f"demo: the anomaly job ended {ended.state.value}: {ended.error}")
    result.published = publish(result.job_dir, home)
    result.job_s = time.monotonic() - started
    runs = RunStore(result.job_dir / "runs.db")
    try:
        run_id = str(runs.runs()[-1]["run_id"])
        names = runs.party_names(run_id)
        for row in runs.party_metrics(run_id):
            result.counted[names[int(row["party"])]] = int(row["metrics"]["num-examples"])
    finally:
        runs.close()
    result.fit_count = fleet_fit(load_arrays(result.job_dir / "final.npz")).count
    for edge, reported in read_thresholds(result.job_dir).items():
        if "calibration_examples" in reported:
            result.calibration[edge] = (
                int(reported["calibration_examples"]),
                int(reported["holdout_examples"]),
            )
    console.print(
        f"published {result.published} in {result.job_s:.0f}s: fitted on "
        f"{result.fit_count} good parts ({_counts(result.counted)}); no image left a station",
        highlight=False,
    )


def _counts(counted: dict[str, int]) -> str:
    return ", ".join(f"{edge} {n}" for edge, n in sorted(counted.items()))


def _deploy_beside(
    fleet: Fleet,
    store: Store,
    edges: list[str],
    result: AnomalyChapter,
    console: Console,
    wait: Any,
) -> None:
    """The anomaly model beside each station's classifier, then each station's own
    recommended threshold (what ``set-threshold all --anomaly recommended`` pushes)."""
    name, _, version = result.published.partition(":")
    deployed = {edge: fleet.deployed_model(edge) for edge in edges}
    classifiers = {model for model in deployed.values() if model is not None}
    if len(classifiers) != 1:
        raise RuntimeError(f"demo: the stations serve {sorted(classifiers)}, expected one model")
    classifier_name, classifier_version = classifiers.pop()
    result.classifier = f"{classifier_name}:{classifier_version}"
    deployment = fleet.deploy(
        classifier_name, classifier_version, edges, anomaly=(name, int(version))
    )

    def active(edge: str) -> bool:
        state = report_store.edge_state(store, edge)
        return state is not None and (state.deploy_id, state.deploy_stage) == (deployment, "active")

    wait(
        lambda: all(active(e) for e in edges), 90, f"deployment {deployment} with its anomaly model"
    )
    result.thresholds = {edge: fleet.recommended_anomaly_threshold(edge)[0] for edge in edges}
    for p in fleet.set_anomaly_thresholds(result.thresholds):
        wait(lambda p=p: config_applied(store, p), 30, f"the anomaly threshold on {p.edge}")
    console.print(
        f"{result.published} serves beside {result.classifier}; each station's anomaly "
        "threshold is its own (false-alarm rate "
        f"{FALSE_ALARM_RATE:.0%} on its good parts scored out of sample): "
        + ", ".join(f"{e} {t:.1f}" for e, t in sorted(result.thresholds.items())),
        highlight=False,
    )


def score_parts(port: int, edge: str, *, seed: int) -> list[ScoredPart]:
    """Score fresh parts through the station's local API (the images stay there)."""
    dents = 1.0 if edge in DENT_STATIONS else 0.0
    images, labels = make_defect_images(
        SCORE_IMAGES, seed=seed, scratch_fraction=DEFECT_FRACTION, dent_fraction=dents
    )
    defect = DENT if dents else SCRATCH
    parts = []
    for image, label in zip(images, labels, strict=True):
        buffer = io.BytesIO()
        Image.fromarray(image).save(buffer, format="PNG")
        record = post_json(f"http://127.0.0.1:{port}/v1/score", buffer.getvalue(), "image/png")
        parts.append(part_of(edge, GOOD if int(label) == 0 else defect, record))
    return parts


def part_of(edge: str, truth: str, record: dict[str, Any]) -> ScoredPart:
    """A station's prediction record (its JSON) as a scored part."""
    anomaly = record.get("anomaly") or {}
    score = anomaly.get("score")
    threshold = anomaly.get("threshold")
    decision = str(record["decision"])
    # Novel as the station and the manager call it (PredictionRecord.novel).
    novel = is_novel(
        decision,
        {str(k): float(v) for k, v in (record.get("scores") or {}).items()},
        None if score is None else float(score),
        None if threshold is None else float(threshold),
    )
    return ScoredPart(
        edge,
        str(record["prediction_id"]),
        truth,
        decision,
        None if score is None else float(score),
        None if threshold is None else float(threshold),
        novel,
    )


def labels_queue(home: ManagerHome) -> list[dict[str, Any]]:
    """The label queue as the operator sees it: ``fedge labels queue --json``."""
    command = [fedge_executable(), "labels", "queue", "--json", "--limit", str(QUEUE_LIMIT)]
    done = subprocess.run(
        [*command, "--home", str(home.root)], capture_output=True, text=True, timeout=120
    )
    if done.returncode != 0:
        raise RuntimeError(f"demo: fedge labels queue failed ({done.returncode}): {done.stderr}")
    items: list[dict[str, Any]] = json.loads(done.stdout)["items"]
    return items


def _label_novel(
    home: ManagerHome, fleet: Fleet, result: AnomalyChapter, novel: list[dict[str, Any]]
) -> None:
    """The operator labels the novel parts the queue put first, with what they are: a dent
    with the defect class, a good part clean. The very first through ``fedge labels add``
    as typed; the rest through the call it makes (``Fleet.add_label``), not a process each."""
    truth = {p.prediction_id: p.truth for p in result.parts}
    for item in novel:
        pid = str(item["prediction_id"])
        label = CLASSES[0] if truth.get(pid, GOOD) == GOOD else CLASSES[1]
        if not result.labelled:
            command = [fedge_executable(), "labels", "add", pid, label, "--who", OPERATOR]
            done = subprocess.run(
                [*command, "--home", str(home.root)], capture_output=True, text=True, timeout=120
            )
            if done.returncode != 0:
                raise RuntimeError(f"demo: fedge labels add failed: {done.stderr}")
        else:
            fleet.add_label(pid, label, OPERATOR)
        result.labelled[pid] = label


def tally(parts: list[ScoredPart], edge: str) -> dict[str, int]:
    """One station's counts: dents, those the classifier passed, those flagged novel; good
    parts and those flagged novel (false alarms)."""
    mine = [p for p in parts if p.edge == edge]
    dents = [p for p in mine if p.truth == DENT]
    good = [p for p in mine if p.truth == GOOD]
    return {
        "dents": len(dents),
        "dents_passed": sum(p.decision == "accept" for p in dents),
        "dents_novel": sum(p.novel for p in dents),
        "good": len(good),
        "good_novel": sum(p.novel for p in good),
    }


def _print_parts(result: AnomalyChapter, console: Console) -> None:
    table = Table(
        "station", "threshold", "dents", "passed by the classifier", "novel", "good parts",
        "good called novel", title=f"fresh parts at each station ({result.published})",
    )  # fmt: skip
    for edge in sorted({p.edge for p in result.parts}):
        t = tally(result.parts, edge)
        threshold = result.thresholds.get(edge)
        table.add_row(
            edge, "-" if threshold is None else f"{threshold:.1f}", str(t["dents"]),
            str(t["dents_passed"]), str(t["dents_novel"]), str(t["good"]), str(t["good_novel"]),
        )  # fmt: skip
    console.print(table)


def plot_data(parts: list[ScoredPart]) -> dict[str, StationPlot]:
    """Each station's anomaly scores, split for the plot (parts without a score left out)."""
    by_edge: dict[str, StationPlot] = {}
    for edge in sorted({p.edge for p in parts}):
        mine = [p for p in parts if p.edge == edge and p.anomaly_score is not None]
        thresholds = {p.threshold for p in mine if p.threshold is not None}

        def scores(keep: Any, mine: list[ScoredPart] = mine) -> list[float]:
            return [float(p.anomaly_score or 0.0) for p in mine if keep(p)]

        by_edge[edge] = StationPlot(
            threshold=max(thresholds) if thresholds else None,
            good=scores(lambda p: p.truth == GOOD),
            novel_dents=scores(lambda p: p.truth == DENT and p.novel),
            missed_dents=scores(
                lambda p: p.truth == DENT and p.decision == "accept" and not p.novel
            ),
            rejected_dents=scores(lambda p: p.truth == DENT and p.decision != "accept"),
            scratches=scores(lambda p: p.truth == SCRATCH),
        )
    return by_edge


def plot(result: AnomalyChapter, path: Path) -> None:
    """Anomaly scores per station: good parts vs dents, with each station's threshold."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    from matplotlib.ticker import LogLocator, NullFormatter, ScalarFormatter

    data = plot_data(result.parts)
    rng = np.random.default_rng(0)  # jitter only: where a point sits across its column
    fig, ax = plt.subplots(figsize=(8.4, 3.8))
    series = (
        ("good", "o", "tab:green", "good part"),
        ("novel_dents", "X", "tab:red", "dent: passed, flagged novel"),
        ("missed_dents", "x", "tab:orange", "dent: passed, under threshold"),
        ("rejected_dents", "^", "tab:purple", "dent: rejected by the classifier"),
        ("scratches", ".", "tab:gray", "scratch"),
    )
    shown: set[str] = set()  # each label once in the legend ("_nolegend_": matplotlib's)
    for column, station in enumerate(data.values()):
        for key, marker, colour, label in series:
            values: list[float] = getattr(station, key)
            if not values:
                continue
            xs = column + rng.uniform(-0.25, 0.25, len(values))
            ax.scatter(
                xs, values, marker=marker, color=colour, s=22, alpha=0.8,
                label="_nolegend_" if label in shown else label,
            )  # fmt: skip
            shown.add(label)
        if station.threshold is not None:
            ax.hlines(
                station.threshold, column - 0.4, column + 0.4, colors="black",
                label="_nolegend_" if "threshold" in shown else "the station's threshold",
            )  # fmt: skip
            shown.add("threshold")
    ax.set_xticks(range(len(data)), list(data))
    ax.set_yscale("log")
    ax.yaxis.set_major_locator(LogLocator(base=10, subs=(1.0, 2.0, 5.0)))
    ax.yaxis.set_major_formatter(ScalarFormatter())
    ax.yaxis.set_minor_formatter(NullFormatter())
    ax.set_ylabel("anomaly score (max Mahalanobis distance)")
    ax.set_title(f"{result.published}: anomaly scores per station")
    ax.legend(fontsize=7, loc="upper left", bbox_to_anchor=(1.01, 1.0))
    fig.tight_layout()
    fig.savefig(path, dpi=110)
    plt.close(fig)


def report_lines(result: AnomalyChapter) -> list[str]:
    """The chapter's Markdown section."""
    lines = [
        "## What normal looks like",
        "",
        f"An anomaly fleet job fitted {result.published} on the parts operators had labelled "
        f"good at every station ({_counts(result.counted)}; {result.fit_count} in all): "
        "each station sent the count, sum and sum of outer products of its parts' features, "
        f"never an image, in {result.job_s:.0f} s. It serves beside {result.classifier}, and "
        "each station calls a part novel over its own threshold, pushed with "
        "`fedge edge set-threshold all --anomaly recommended`.",
        "",
        f"A station's threshold at a {FALSE_ALARM_RATE:.0%} false-alarm rate is conformal: "
        f"it rests on at least {min_parts_for(FALSE_ALARM_RATE)} good parts scored out of "
        "sample, and a new good part exceeds it with a chance of about that rate. Those are "
        "the station's held-out good parts, and its good training parts, each scored under "
        "the fleet's fit without it (the job sends the pooled sums back): "
        + ", ".join(
            f"{edge} {n} ({held} held out)"
            for edge, (n, held) in sorted(result.calibration.items())
        )
        + ".",
        "",
        f"Then {', '.join(DENT_STATIONS)} saw dents, a defect shape the classifier never saw:",
        "",
        "| station | threshold | dents | passed by the classifier | novel | good parts "
        "| good parts called novel |",
        "|---|---|---|---|---|---|---|",
    ]
    for edge in sorted({p.edge for p in result.parts}):
        t = tally(result.parts, edge)
        threshold = result.thresholds.get(edge)
        lines.append(
            f"| {edge} | {'-' if threshold is None else f'{threshold:.1f}'} | {t['dents']} | "
            f"{t['dents_passed']} | {t['dents_novel']} | {t['good']} | {t['good_novel']} |"
        )
    first = sum(1 for item in result.queue if item.get("novel"))
    dents = sum(1 for label in result.labelled.values() if label != CLASSES[0])
    lines += [
        "",
        f"`fedge labels queue` put the novel parts first ({first} on its first page of "
        f"{len(result.queue)}); the operator labelled them, a page at a time "
        f"({len(result.labelled)} in all: {dents} dents as `{CLASSES[1]}`, the rest "
        f"`{CLASSES[0]}`). The classifier's classes stay {' / '.join(CLASSES)}: a new class "
        "needs a new output layer, its own threshold and gate, more than the demo's minutes; "
        "a dent is labelled with the defect class, and the next fleet job (below) trains on "
        "those labels and learns to reject dents.",
        "",
        "![anomaly scores per station](anomaly-scores.png)",
        "",
    ]
    return lines


def summary(result: AnomalyChapter) -> dict[str, Any]:
    """The chapter's part of ``summary.json`` (the checks read it)."""
    return {
        "job_dir": str(result.job_dir),
        "published": result.published,
        "classifier": result.classifier,
        "job_s": result.job_s,
        "dent_stations": list(DENT_STATIONS),
        "counted": result.counted,
        "calibration": {e: list(c) for e, c in result.calibration.items()},
        "fit_count": result.fit_count,
        "thresholds": result.thresholds,
        "parts": [dataclasses.asdict(p) for p in result.parts],
        "queue": [{"prediction_id": i["prediction_id"], "novel": i["novel"]} for i in result.queue],
        "queue_after": [
            {"prediction_id": i["prediction_id"], "novel": i["novel"]} for i in result.queue_after
        ],
        "labelled": result.labelled,
    }
